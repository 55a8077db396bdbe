#!/usr/bin/env bash
# Tiny GPT pre-training on 2 CPU ranks (gloo) with a checkpoint round trip: three short runs, 1-2 minutes
# on 2 cores.
#
#   bash examples/run_tiny_cpu.sh [RUN_DIR]   # default runs/tiny_cpu; a relative RUN_DIR is under the repo root
#
# 1. RUN_DIR/resumed: 60 iterations, stopped by --exit-interval 30 after saving iteration 30 ...
# 2. ... then the same command with --load continues from iteration 31 to 60.
# 3. RUN_DIR/straight: the same 60 iterations without a break.
# 4. Checks that the two final checkpoints hold bit-identical weights and Adam moments, and the
#    same 60 losses: resuming restores everything that matters (weights, optimizer state, LR schedule
#    position, data position, RNG).
# Data: the built-in corpus (Python standard-library docstrings, byte-level tokens), built once under
# data/cache. Everything it writes is under RUN_DIR; runs/ is git-ignored.
set -euo pipefail
cd "$(dirname "$0")/.."

RUN_DIR=${1:-runs/tiny_cpu}
NPROC=${NPROC:-2}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}  # one thread per rank (torchrun's default, without its warning)
rm -rf "$RUN_DIR/resumed" "$RUN_DIR/straight"  # only the sub-directories this script owns

# --model-preset tiny: 2 layers, hidden 128, 4 heads, seq 128. global batch 16 = micro-batch 4 x 2 ranks
# x 2 accumulated micro-batches. Warmup defaults to 10% of --train-iters (6), cosine decay to --min-lr.
ARGS=(--model-preset tiny --micro-batch-size 4 --global-batch-size 16 --train-iters 60
      --log-interval 10 --eval-interval 30 --eval-iters 2
      --overlap-grad-reduce --use-distributed-optimizer --save-interval 20)
run() { torchrun --standalone --nproc-per-node "$NPROC" pretrain_gpt.py "${ARGS[@]}" "$@"; }

echo "=== 1. train, save every 20 iterations, stop at iteration 30 (--exit-interval 30)"
run --save "$RUN_DIR/resumed" --exit-interval 30
echo "latest checkpoint: iteration $(cat "$RUN_DIR/resumed/latest_checkpointed_iteration.txt")"

echo "=== 2. resume with --load: iterations 31..60"
run --save "$RUN_DIR/resumed" --load "$RUN_DIR/resumed"

echo "=== 3. the same 60 iterations in one go, for comparison"
run --save "$RUN_DIR/straight"

echo "=== 4. compare"
python - "$RUN_DIR" <<'EOF'
import json, os, sys
sys.path.insert(0, "tools")
from checkpoint_convert import read  # either checkpoint format, in the `torch` format's layout

run_dir = sys.argv[1]
def final(name):
    return read(os.path.join(run_dir, name, "iter_0000060"))
def losses(name):  # metrics.jsonl is appended to, so the resumed run's file holds both halves
    records = [json.loads(line) for line in open(os.path.join(run_dir, name, "metrics.jsonl"))]
    return {r["iteration"]: r["lm_loss"] for r in records if "lm_loss" in r}
a, b = final("resumed"), final("straight")
weights = max((a["model"][k].float() - b["model"][k].float()).abs().max().item() for k in a["model"])
moments = max((a["optimizer"]["state"][n][m] - b["optimizer"]["state"][n][m]).abs().max().item()
              for n in a["optimizer"]["state"] for m in ("exp_avg", "exp_avg_sq"))
la, lb = losses("resumed"), losses("straight")
same_losses = sorted(la) == list(range(1, 61)) and la == lb
print(f"> resumed vs straight at iteration 60: max |weight diff| = {weights:.1e}, "
      f"max |Adam moment diff| = {moments:.1e}, losses of iterations 1..60 identical: {same_losses}")
if weights or moments or not same_losses:
    sys.exit("> resume was not exact")
print("> resume is exact")
EOF
echo "checkpoints and metrics.jsonl under $RUN_DIR/"
