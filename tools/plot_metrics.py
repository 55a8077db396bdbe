"""Plot the loss curves of one or several runs from their --metrics-file records, without TensorBoard.

    python tools/plot_metrics.py runs/a/metrics.jsonl                                 # -> runs/a/metrics.png
    python tools/plot_metrics.py runs/a/metrics.jsonl runs/b/metrics.jsonl --label a --label b --out ab.png
    python tools/plot_metrics.py runs/a/metrics.jsonl --lr --grad-norm                # two more panels below

The files are what pretrain_gpt.py writes to --metrics-file (megatron_lite/training/metrics.py): one JSON object
per line, a training record per iteration ({iteration, consumed_samples, lm_loss, lr, loss_scale, grad_norm,
skipped}), a timing record per log interval, and a validation record per evaluation ({iteration, valid_lm_loss,
valid_lm_loss_ppl}). The top panel has every run's training losses (solid) and validation losses (dashed, one
point per evaluation) against the iteration, one colour per run; --lr and --grad-norm add panels on the same
iterations. A run without validation records has no dashed line; a value that is null (grad norm of a skipped
iteration) leaves a gap.

A resumed run appends to the same file, so iterations between its last checkpoint and the interruption appear
twice: the last record of an iteration is plotted (the run that went on), and the tool says how many iterations
it found more than once. Anything that is not a JSON object with an integer "iteration" is refused, naming the
file and line. matplotlib is the optional `bench` extra (pip install -e ".[bench]"); nothing else is needed.
"""

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional

TRAINING_FIELDS = ("iteration", "consumed_samples", "lr", "loss_scale", "grad_norm", "skipped")
"""The keys of a training record that are not losses (metrics.py's TrainingLog.training)."""


@dataclass
class Run:
    """One file's series, each {iteration: value}, the last record of an iteration winning."""

    label: str
    losses: Dict[str, Dict[int, Optional[float]]] = field(default_factory=dict)
    """Training loss key ('lm_loss') -> values."""
    valid: Dict[str, Dict[int, Optional[float]]] = field(default_factory=dict)
    """Validation loss key without its 'valid_' prefix -> values."""
    lr: Dict[int, Optional[float]] = field(default_factory=dict)
    grad_norm: Dict[int, Optional[float]] = field(default_factory=dict)
    repeated: int = 0
    """Training iterations recorded more than once (a resume appends to the file)."""


def _number(value) -> Optional[float]:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def read_run(path: str, label: str) -> Run:
    """Read one --metrics-file. Raises ValueError naming `path` and the line for what is not a metrics record,
    and for a file without any training loss."""
    run = Run(label)
    with open(path, "rb") as f:
        for number, raw in enumerate(f, 1):
            where = f"{path}:{number}"
            try:
                text = raw.decode("utf-8").strip()
            except UnicodeDecodeError:
                raise ValueError(f"{where}: not UTF-8 text; give the JSONL file pretrain_gpt.py wrote with "
                                 f"--metrics-file") from None
            if not text:
                continue
            try:
                record = json.loads(text)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: not a JSON line ({e.msg}); give the JSONL file pretrain_gpt.py wrote "
                                 f"with --metrics-file") from None
            if not isinstance(record, dict):
                raise ValueError(f"{where}: a JSON {type(record).__name__}, not a metrics record (an object)")
            iteration = record.get("iteration")
            if not isinstance(iteration, int) or isinstance(iteration, bool):
                raise ValueError(f"{where}: a record without an integer 'iteration' (got {iteration!r})")
            _add(run, iteration, record)
    if not run.losses:
        raise ValueError(f"{path}: no training record (with 'consumed_samples' and a loss) in the file")
    return run


def _add(run: Run, iteration: int, record: dict):
    if "consumed_samples" in record:  # a training record
        run.repeated += iteration in run.lr
        run.lr[iteration] = _number(record.get("lr"))
        run.grad_norm[iteration] = _number(record.get("grad_norm"))
        for key, value in record.items():
            if key not in TRAINING_FIELDS:
                run.losses.setdefault(key, {})[iteration] = _number(value)
    for key, value in record.items():  # a validation record: valid_<loss>, valid_<loss>_ppl
        if key.startswith("valid_") and not key.endswith("_ppl"):
            run.valid.setdefault(key[len("valid_"):], {})[iteration] = _number(value)


def labels_for(paths: List[str], given: Optional[List[str]]) -> List[str]:
    """--label per file, else the file names without .jsonl (the paths as given where names repeat)."""
    if given:
        if len(given) != len(paths):
            raise ValueError(f"--label given {len(given)} times for {len(paths)} files: give one per file, in order")
        return given
    names = [os.path.splitext(os.path.basename(p))[0] for p in paths]
    return names if len(set(names)) == len(names) else list(paths)


def _series(values: Dict[int, Optional[float]]):
    """Sorted (x, y), a gap (NaN) where a value is null."""
    xs = sorted(values)
    return xs, [math.nan if values[x] is None else values[x] for x in xs]


def pyplot():
    """matplotlib.pyplot on the Agg backend; a ValueError naming the extra when matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ValueError("tools/plot_metrics.py needs matplotlib, the optional 'bench' extra: "
                         "pip install -e \".[bench]\" (or pip install matplotlib)") from None
    return plt


def plot(runs: List[Run], out: str, lr: bool = False, grad_norm: bool = False, title: Optional[str] = None):
    """Write the figure (see the module docstring) to `out` (its extension picks the format)."""
    plt = pyplot()
    panels = ["loss"] + ["lr"] * lr + ["grad_norm"] * grad_norm
    heights = [3] + [1.4] * (len(panels) - 1)
    fig, axes = plt.subplots(len(panels), 1, figsize=(9, sum(heights) + 1.2), sharex=True, squeeze=False,
                             gridspec_kw=dict(height_ratios=heights))
    axes = dict(zip(panels, axes[:, 0]))
    for i, run in enumerate(runs):
        color = f"C{i % 10}"
        several = len(run.losses) > 1  # name the loss only when a run reports more than one
        for key, values in run.losses.items():
            axes["loss"].plot(*_series(values), "-", color=color, lw=1.2,
                              label=f"{run.label}: train {key}" if several else f"{run.label}: train")
        for key, values in run.valid.items():
            axes["loss"].plot(*_series(values), "o--", color=color, ms=5, lw=1,
                              label=f"{run.label}: validation {key}" if several else f"{run.label}: validation")
        if lr:
            axes["lr"].plot(*_series(run.lr), "-", color=color, lw=1.2)
        if grad_norm:
            axes["grad_norm"].plot(*_series(run.grad_norm), "-", color=color, lw=1)
    axes["loss"].set_ylabel("loss")
    axes["loss"].legend(fontsize=8)
    if lr:
        axes["lr"].set_ylabel("learning rate")
        axes["lr"].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    if grad_norm:
        axes["grad_norm"].set_ylabel("grad norm")
    for ax in axes.values():
        ax.grid(True, alpha=0.3)
    axes[panels[-1]].set_xlabel("iteration")
    if title:
        axes["loss"].set_title(title, fontsize=11)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="METRICS_JSONL", help="--metrics-file files of pretrain_gpt.py runs")
    p.add_argument("--label", action="append", help="a run's name in the legend, once per file in order "
                   "(default: the file names, or the paths where file names repeat)")
    p.add_argument("--out", help="the picture (.png, .svg, .pdf; default: the first file with .png for .jsonl)")
    p.add_argument("--lr", action="store_true", help="add a panel with the learning rate")
    p.add_argument("--grad-norm", action="store_true", help="add a panel with the gradient norm")
    p.add_argument("--title", help="a title above the loss panel")
    args = p.parse_args(argv)
    out = args.out or os.path.splitext(args.files[0])[0] + ".png"
    try:
        runs = [read_run(path, label) for path, label in zip(args.files, labels_for(args.files, args.label))]
        plot(runs, out, lr=args.lr, grad_norm=args.grad_norm, title=args.title)
    except (OSError, ValueError) as e:
        p.error(str(e))
    for path, run in zip(args.files, runs):
        valid = sum(len(v) for v in run.valid.values())
        print(f"{path}: {len(run.lr)} iterations, {valid} validation point(s)"
              + (f"; {run.repeated} iteration(s) recorded more than once (a resume): the last record of each "
                 f"is plotted" if run.repeated else ""))
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.exit(main())
