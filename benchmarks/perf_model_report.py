"""perf_model.py put to use: validate it against measured steps, and predict for a cluster.

    # calibrate at dp=2, predict the steps measured at dp=3 and dp=4 (files from perf_model_calibrate.py)
    python -m benchmarks.perf_model_report --calibration dp2.json --validate dp3.json dp4.json \\
        --out docs/img/perf_model_validation.png

    # what bucket size for dp=256 at 400 Gb/s, 5 us? (also: bucket_size_sweep.py --predict ...)
    python -m benchmarks.perf_model_report --predict --dp 256 --bandwidth-gbps 400 --latency-us 5

Validation takes alpha, beta (the all-reduce samples) and the overlap (the measured steps) from the
calibration file only; the compute timeline of each validated world size is the one measured there with no
traffic (on a shared 2-core machine 3 or 4 ranks slow compute itself down, a property of the machine that no
network model knows; on a cluster each rank has its own accelerator and the timeline does not change with
dp). A prediction for a cluster takes the calibration's timeline (scaled by --compute-scale, e.g. 0.01 for
an accelerator 100x faster than this CPU, or a timeline recorded there) and the link's alpha and beta.
"""

import argparse

from benchmarks import perf_model as pm
from benchmarks.prediction import add_predict_flags, check_predict_flags, load, plot, predict


def calibrate(data):
    """(link, overlap) fitted on one calibration file."""
    link = pm.fit_link([tuple(s) for s in data["samples"]])
    return link, pm.fit_overlap(data["timeline"], link, data["measured"], data["world"])


def validate(args):
    base = load(args.calibration)
    link, overlap = calibrate(base)
    print(f"calibrated at dp={base['world']}: alpha {link.alpha * 1e6:.1f} us, beta {1 / link.beta / 1e9:.2f} GB/s, "
          f"overlap {overlap:.2f}\n")
    print("| dp | bucket size | buckets | measured ms | predicted ms | error |")
    print("|---|---|---|---|---|---|")
    series = {}
    for path in [args.calibration, *args.validate]:
        data = load(path)
        for size, seconds in sorted(data["measured"].items()):
            pred = pm.predict(data["timeline"], size, data["world"], link, overlap=overlap)
            series.setdefault(data["world"], []).append((size, seconds, pred["step"]))
            print(f"| {data['world']} | {size} | {pred['buckets']} | {seconds * 1e3:.1f} | {pred['step'] * 1e3:.1f} | "
                  f"{pred['step'] / seconds - 1:+.0%} |")
    worst = max(abs(p / m - 1) for dp, rows in series.items() if dp != base["world"] for _, m, p in rows)
    print(f"\nlargest error at the predicted world sizes: {worst:.0%}")
    if args.out:
        plot(series, args.out, "measured (dots) vs predicted (lines) step time; calibrated at dp=2")


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--predict", action="store_true", help="predict for --dp, --bandwidth-gbps, --latency-us")
    p.add_argument("--validate", nargs="*", default=[], help="calibration files of other world sizes to predict")
    p.add_argument("--use-distributed-optimizer", action="store_true")
    p.add_argument("--out", help="plot (PNG)")
    add_predict_flags(p)
    args = p.parse_args()
    check_predict_flags(p, args)
    if args.predict:
        predict(args)
    else:
        validate(args)


if __name__ == "__main__":
    main()
