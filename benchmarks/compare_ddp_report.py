"""benchmarks/compare_ddp.py's report: the printed tables, compare_ddp.csv / .json and compare_ddp.png."""

import json
import os
import platform

import torch
import torch.distributed as dist

from benchmarks.reporting import pyplot, write_csv

MIB = 2**20


def machine(args, device, numel) -> dict:
    cpu = platform.processor()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), cpu)
    return dict(torch=torch.__version__, backend=dist.get_backend(), world_size=dist.get_world_size(),
                device=device.type, device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else cpu,
                cpus=os.cpu_count(), threads_per_rank=torch.get_num_threads(), parameters=numel,
                config={k: v for k, v in vars(args).items() if k not in ("out_dir", "trace")})


def report(args, info, rows, losses, overlap):
    cuda = info["device"] == "cuda"
    mem_key, mem = ("peak_bytes_per_rank", "peak MiB/rank") if cuda else ("model_state_bytes_per_rank",
                                                                         "model-state MiB/rank")
    print(f"{info['backend']}, {info['world_size']} ranks, torch {info['torch']}, {info['device_name']} "
          f"({info['cpus']} CPUs, {info['threads_per_rank']} thread/rank); GPT, {info['parameters']:,} parameters; "
          f"median of {args.repeats} x {args.steps} steps per system ({args.warmup_steps} warm-up), alternating\n")
    print(f"| system          | step ms | / torch-ddp | {mem} | opt-state MiB/rank | comm MB/rank/step | "
          f"loss diff vs ml-ddp |\n|-----------------|---------|-------------|{'-' * (len(mem) + 2)}|"
          f"--------------------|-------------------|---------------------|")
    for r in rows:
        print(f"| {r['system']:<15} | {r['median_step_ms']:>7.1f} | {r['ratio_to_torch_ddp']:>10.2f}x | "
              f"{max(r[mem_key]) / MIB:>{len(mem)}.2f} | {max(r['optimizer_state_bytes_per_rank']) / MIB:>18.2f} | "
              f"{r['comm_bytes_per_rank_per_step'] / 1e6:>17.2f} | {r['loss_max_abs_diff_vs_ml_ddp']:>19.2e} |")
    print("\nCollectives of one step (algorithmic bytes per rank: all-reduce 2(N-1)/N x size, the others "
          "(N-1)/N x full size):")
    for r in rows:
        print(f"  {r['system']:<15} {r['collectives']}  [{r['comm_method']}]")
    agree = all(r["losses_agree"] for r in rows)
    print(f"\nlosses of the first {losses.shape[1]} steps agree with ml-ddp within {args.loss_tol:g}: {agree}")
    if overlap:
        hidden = "n/a" if overlap["hidden_fraction"] is None else f"{100 * overlap['hidden_fraction']:.0f}%"
        print(f"\nOverlap study (ml-ddp, bucket_size {args.bucket_size:,} elements): overlap "
              f"{overlap['overlap_ms']:.1f} ms, no overlap {overlap['no_overlap_ms']:.1f} ms, compute only "
              f"{overlap['compute_only_ms']:.1f} ms -> hidden fraction of communication {hidden}"
              + ("" if cuda else "\n(CPU/gloo: gloo's threads compete with compute for the same cores)"))
    os.makedirs(args.out_dir, exist_ok=True)
    write_csv(os.path.join(args.out_dir, "compare_ddp.csv"), rows)  # per-rank lists: space-separated
    with open(os.path.join(args.out_dir, "compare_ddp.json"), "w") as f:
        json.dump(dict(machine=info, systems=rows, overlap_study=overlap, losses_agree=agree,
                       losses={r["system"]: losses[k].tolist() for k, r in enumerate(rows)}), f, indent=2)
    plot(args, info, rows, mem_key, mem)
    print(f"\nwrote compare_ddp.csv and compare_ddp.json to {args.out_dir}")


def plot(args, info, rows, mem_key, mem):
    plt = pyplot()
    if plt is None:
        return
    names = [r["system"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.bar_label(ax1.bar(names, [r["median_step_ms"] for r in rows]),
                  [f"{r['ratio_to_torch_ddp']:.2f}x" for r in rows])
    ax1.set_ylabel("median step time, ms (label: / torch-ddp)")
    totals = [max(r[mem_key]) / MIB for r in rows]
    ax2.bar(names, totals, label=mem.split(" MiB")[0])
    ax2.bar(names, [max(r["optimizer_state_bytes_per_rank"]) / MIB for r in rows], label="of which optimizer state")
    ax2.set(ylabel=mem, ylim=(0, 1.3 * max(totals)))
    ax2.legend(ncol=2)
    for ax in (ax1, ax2):
        ax.tick_params(axis="x", rotation=20)
    fig.suptitle(f"GPT {info['parameters']:,} parameters, {info['world_size']} ranks, {info['backend']}, "
                 f"{info['device_name']}, torch {info['torch']}")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out_dir, "compare_ddp.png"), dpi=120)
    print(f"wrote compare_ddp.png to {args.out_dir}")
