"""Predicting a cluster's step time against the bucket size from a calibration file (perf_model.py), shared
by perf_model_report.py and bucket_size_sweep.py --predict: the --predict flags, the calibration loader,
the table printer and the plot.
"""

import json
import os

from benchmarks import perf_model as pm

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_CALIBRATION = os.path.join(REPO, "docs", "data", "perf_model_dp2.json")
SIZES = [2**k for k in range(12, 29)]  # 4K .. 256M elements


def load(path):
    with open(path) as f:
        data = json.load(f)
    data["timeline"] = pm.Timeline(**data["timeline"])
    data["measured"] = {int(b): t for b, t in data["measured"].items()}
    return data


def plot(series, out, title):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("(matplotlib not installed: no plot)")
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for dp, rows in sorted(series.items()):
        sizes = [r[0] for r in rows]
        line = ax.plot(sizes, [r[2] * 1e3 for r in rows], label=f"dp={dp} predicted")[0]
        if rows[0][1] is not None:
            ax.plot(sizes, [r[1] * 1e3 for r in rows], "o", color=line.get_color(), label=f"dp={dp} measured")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("bucket size (elements)")
    ax.set_ylabel("step (ms)")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def predict(args):
    data = load(args.calibration)
    link = pm.Link.from_network(args.latency_us, args.bandwidth_gbps)
    overlap = args.overlap if args.overlap is not None else 1.0
    timeline = data["timeline"].scaled(args.compute_scale)
    one = 1 << (sum(timeline.numels) - 1).bit_length()  # the first power of two that is a single bucket
    sizes = [s for s in SIZES if s < one] + [one]
    best, table = pm.recommend(timeline, sizes, args.dp, link, args.algorithm, overlap=overlap,
                               distributed_optimizer=args.use_distributed_optimizer)
    compute = timeline.forward + timeline.backward + timeline.optimizer
    print(f"dp={args.dp}, {args.bandwidth_gbps:g} Gb/s, {args.latency_us:g} us, {args.algorithm}, overlap {overlap:g}; "
          f"model of {sum(timeline.numels):,} parameters, compute {compute * 1e3:.2f} ms per step "
          f"(timeline from {os.path.relpath(args.calibration)} x {args.compute_scale:g})\n")
    print("| bucket size | buckets | predicted step ms | exposed communication ms |")
    print("|---|---|---|---|")
    for size, row in table.items():
        print(f"| {size} | {row['buckets']} | {row['step'] * 1e3:.3f} | {row['exposed'] * 1e3:.3f} |")
    print(f"\nrecommended bucket size: {best} elements ({table[best]['buckets']} buckets), predicted step "
          f"{table[best]['step'] * 1e3:.3f} ms (exposed communication {table[best]['exposed'] * 1e3:.3f} ms)")
    if args.out:
        plot({args.dp: [(s, None, r["step"]) for s, r in table.items()]}, args.out,
             f"predicted step vs bucket size, dp={args.dp}, {args.bandwidth_gbps:g} Gb/s, {args.latency_us:g} us")
    return best


def add_predict_flags(p):
    p.add_argument("--dp", type=int, default=64, help="data-parallel size to predict for (default 64)")
    p.add_argument("--bandwidth-gbps", type=float, default=100.0, help="per-rank link bandwidth, Gb/s (default 100)")
    p.add_argument("--latency-us", type=float, default=5.0, help="latency per message step, us (default 5)")
    p.add_argument("--algorithm", choices=["ring", "tree"], default="ring", help="all-reduce algorithm (default ring)")
    p.add_argument("--overlap", type=float, help="fraction of communication that can hide behind backward (default "
                   "1: GPUs with NCCL; this CPU's calibration fits 0)")
    p.add_argument("--compute-scale", type=float, default=1.0, help="multiply the calibration's compute timeline "
                   "(e.g. 0.01 for an accelerator 100x faster than the CPU that recorded it)")
    p.add_argument("--calibration", default=DEFAULT_CALIBRATION, help="a perf_model_calibrate.py file (default: "
                   "docs/data/perf_model_dp2.json, this machine at dp=2)")


def check_predict_flags(p, args):
    for name in ("dp", "bandwidth_gbps", "compute_scale"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be > 0")
    if args.latency_us < 0 or (args.overlap is not None and not 0 <= args.overlap <= 1):
        p.error("--latency-us must be >= 0 and --overlap in [0, 1]")
