"""benchmarks/bucket_size_sweep.py's report: the rows (medians of the samples), the printed table, the CSV next to
the plot, and the plot."""

import os
from typing import List, Optional

import torch

from benchmarks.reporting import pyplot, write_csv

# The two reference rows of the sweep (no bucket size of their own).
COMPUTE_ONLY, OVERLAP_OFF = "compute only", "overlap off"


def summarize(names: List[str], bucket_sizes: List[Optional[int]], num_buckets: List[int],
              samples: torch.Tensor) -> List[dict]:
    """One row per configuration, in ms.

    Args:
        names: the configurations, the compute-only reference last.
        samples: [configuration, sample, column] seconds (timing.Timings.samples); columns: the step, then
            train_step's finish_grad_sync, parameter all-gather and their sum (the wait on communication).

    exposed_comm_ms is the median of the measured waits: each sample a sum of durations, so it cannot be negative
    (step - compute only, a difference of two medians of different configurations, was negative whenever the
    noise exceeded what communication costs, and with the distributed optimizer, whose compute-only reference
    updates every parameter at dp=1, by construction). That difference is kept as step_minus_compute_only_ms,
    signed.
    """
    q = torch.quantile(samples * 1e3, torch.tensor([0.25, 0.5, 0.75], dtype=samples.dtype), dim=1).tolist()
    step, compute = 0, q[1][-1][0]  # [quantile][config][column]
    finish, gather, exposed = 1, 2, 3
    return [dict(config=name, bucket_size="" if b is None else b, num_buckets=n,
                 step_ms=q[1][i][step], exposed_comm_ms=q[1][i][exposed], finish_grad_sync_ms=q[1][i][finish],
                 param_gather_ms=q[1][i][gather], step_minus_compute_only_ms=q[1][i][step] - compute,
                 step_p25_ms=q[0][i][step], step_p75_ms=q[2][i][step])
            for i, (name, b, n) in enumerate(zip(names, bucket_sizes, num_buckets))]


def report(args, rows, numel, world, backend, recommendation):
    choice, line = recommendation
    print(f"\nGPT {args.num_layers} layers, hidden {args.hidden_size}, {args.num_attention_heads} heads, seq "
          f"{args.seq_length}, vocab {args.vocab_size}, micro-batch {args.micro_batch_size}: {numel} parameters | "
          f"{backend}, {world} ranks, {torch.get_num_threads()} thread(s)/rank, torch {torch.__version__}, "
          f"{'distributed' if args.use_distributed_optimizer else 'fp32'} optimizer | median of "
          f"{args.repeats} x {args.steps} steps, slowest rank\n")
    print(f"| {'bucket_size':>22} | {'buckets':>7} | {'step ms':>8} | {'exposed comm ms':>15} | "
          f"{'finish_grad_sync ms':>19} |")
    print(f"|{'-' * 24}|{'-' * 9}|{'-' * 10}|{'-' * 17}|{'-' * 21}|")
    for r in rows:
        print(f"| {r['config']:>22} | {r['num_buckets']:>7} | {r['step_ms']:>8.1f} | {r['exposed_comm_ms']:>15.1f} | "
              f"{r['finish_grad_sync_ms']:>19.1f} |")
    print("exposed comm: the time the step waits on communication, measured (finish_grad_sync + the distributed "
          "optimizer's parameter all-gather)")
    print("\n" + line)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    csv_path = os.path.splitext(args.out)[0] + ".csv"
    write_csv(csv_path, rows, digits=3)
    print(f"table: {csv_path}")
    plot(args, rows, choice, numel, f"{backend} x {world}")


def plot(args, rows, choice, numel, where):
    plt = pyplot()
    if plt is None:
        return
    swept = [r for r in rows if r["config"] not in (OVERLAP_OFF, COMPUTE_ONLY)]
    ref = {r["config"]: r for r in rows}
    x = [r["bucket_size"] for r in swept]
    fig, ax = plt.subplots(figsize=(9, 6))
    ax.plot(x, [r["step_ms"] for r in swept], "o-", color="C0", label="step time (overlap on), median")
    ax.fill_between(x, [r["step_p25_ms"] for r in swept], [r["step_p75_ms"] for r in swept], color="C0", alpha=0.1,
                    label="step time, 25th-75th percentile")
    ax.plot(x, [r["exposed_comm_ms"] for r in swept], "s--", color="C3",
            label="exposed comm (measured wait on communication)")
    if any(r["param_gather_ms"] > 0 for r in swept):  # else the same line as the exposed communication
        ax.plot(x, [r["finish_grad_sync_ms"] for r in swept], "^:", color="C2", label="finish_grad_sync wall time")
    ax.axhline(ref[OVERLAP_OFF]["step_ms"], color="C1",
               label=f"step, overlap off ({ref[OVERLAP_OFF]['step_ms']:.0f} ms)")
    ax.axhline(ref[COMPUTE_ONLY]["step_ms"], color="gray", ls="-.",
               label=f"step, compute only ({ref[COMPUTE_ONLY]['step_ms']:.0f} ms)")
    ax.axhline(0, color="black", lw=0.5)
    for r in swept:
        ax.annotate(f"{r['num_buckets']}", (r["bucket_size"], r["step_ms"]), textcoords="offset points", xytext=(0, 9),
                    ha="center", fontsize=8, color="C0")
    ax.plot([choice["bucket_size"]], [choice["step_ms"]], "*", ms=13, color="gold", mec="black",
            label=f"recommended: {choice['bucket_size']}")
    ax.set_xscale("log", base=2)
    labels = [f"{v >> 20}M" if v >= 2**20 else f"{v >> 10}K" if v >= 2**10 else str(v) for v in x]
    ax.set_xticks(x, labels[:-1] + [labels[-1] + "\none\nbucket"], fontsize=8)
    ax.minorticks_off()
    ax.set_xlabel("bucket_size (elements, log scale; numbers above the points: buckets)")
    ax.set_ylabel("ms (median, slowest rank)")
    ax.set_title(f"GPT {numel / 1e6:.1f}M params, {where}, "
                 f"{'distributed' if args.use_distributed_optimizer else 'fp32'} optimizer", fontsize=11)
    ax.grid(True, which="major", alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3)
    fig.tight_layout()
    fig.savefig(args.out, dpi=110)
    print(f"plot: {args.out}")
