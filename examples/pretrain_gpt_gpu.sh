#!/usr/bin/env bash
# GPT-2 small (125M) pre-training on one node of GPUs: bf16, ZeRO-1, both overlaps, resumable.
#
#   GPUS=8 DATA_PATH=data/my_corpus bash examples/pretrain_gpt_gpu.sh [extra pretrain_gpt.py flags]
#
# Environment (all optional):
#   GPUS             GPUs on this node (default 8); must divide 256 / 8 = 32, see the batch arithmetic below
#   DATA_PATH        PREFIX of PREFIX.bin/.idx made by tools/preprocess_data.py. Unset: the built-in corpus
#                    (stdlib docstrings, ~1.2M byte tokens = ~36 iterations per epoch at this batch size),
#                    only good as a smoke test, so the default length drops to 500 iterations.
#   TOKENIZER_MODEL  a tokenizer.json: trains with HuggingFaceTokenizer (needs `pip install tokenizers`).
#                    It must be the tokenizer DATA_PATH was made with; the default is ByteLevelTokenizer.
#   TRAIN_ITERS      default 20000 with DATA_PATH (256 x 1024 x 20000 = 5.2B tokens), 500 without
#   SAVE_DIR         checkpoints, metrics.jsonl and TensorBoard files (default runs/gpt2-125m).
#                    --load points at the same directory: rerunning the script resumes from the latest
#                    checkpoint, also on a different GPU count (the global batch stays 256).
#
# Batch arithmetic: global batch 256 = micro-batch 8 x GPUS x accumulation steps, so with GPUS=8 each
# rank runs 256 / (8 x 8) = 4 micro-batches per iteration (GPUS=4: 8, GPUS=1: 32); every iteration is
# 256 x 1024 = 262,144 tokens whatever GPUS is. A GPUS that does not divide 32 fails at start-up with a
# "--global-batch-size ... is not divisible" error.
# Flags after the script name are appended and win (argparse keeps the last value), e.g. --eval-iters 20.
# --torch-compile compiles each transformer layer (GPT-2 125M on one H200: 28-29% -> 40-41% MFU, measured at
# world size 1 only; docs/performance.md); the first iterations are slower while it compiles.
set -euo pipefail
cd "$(dirname "$0")/.."

GPUS=${GPUS:-8}
SAVE_DIR=${SAVE_DIR:-runs/gpt2-125m}

DATA_ARGS=()
if [[ -n "${DATA_PATH:-}" ]]; then
    DATA_ARGS+=(--data-path "$DATA_PATH")
    TRAIN_ITERS=${TRAIN_ITERS:-20000}
else
    echo "DATA_PATH is not set: training on the built-in corpus (a smoke test, not a real pre-training run)"
    TRAIN_ITERS=${TRAIN_ITERS:-500}
fi
if [[ -n "${TOKENIZER_MODEL:-}" ]]; then
    DATA_ARGS+=(--tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL")
fi
# Schedule in iterations: 1% linear warmup, then cosine decay to --min-lr (10% of the peak) at the last
# iteration (--lr-decay-iters defaults to --train-iters). Change the length with TRAIN_ITERS, not with an
# appended --train-iters, so that the warmup follows.
WARMUP_ITERS=$(( TRAIN_ITERS / 100 ))

ARGS=(
    # model: 12 layers, hidden 768, 12 heads, seq 1024, learned positions, tied embeddings
    --model-preset gpt2-125m
    --micro-batch-size 8 --global-batch-size 256 --train-iters "$TRAIN_ITERS"
    --bf16                                      # bf16 params, fp32 main params and fp32 gradient reduction
    # optimizer and schedule (GPT-2 / Megatron defaults for this size)
    --optimizer adam --lr 6e-4 --min-lr 6e-5 --lr-decay-style cosine
    --lr-warmup-iters "$WARMUP_ITERS"
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --clip-grad 1.0 --init-method-std 0.02
    # data parallelism: ZeRO-1, reduce-scatter overlapped with backward, all-gather with the next forward
    --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
    # NCCL and the GPU are picked automatically when CUDA is available
    ${DATA_ARGS[@]+"${DATA_ARGS[@]}"} --split 969,30,1   # (this spelling: an empty array is fine with set -u on old bash)
    # logs (MFU on H100/H200/A100/...), evaluation, checkpoints
    --log-interval 10 --eval-interval 1000 --eval-iters 10
    --tensorboard-dir "$SAVE_DIR/tensorboard"   # metrics.jsonl goes there too
    --save "$SAVE_DIR" --save-interval 1000 --load "$SAVE_DIR"
)

exec torchrun --standalone --nproc-per-node "$GPUS" pretrain_gpt.py "${ARGS[@]}" "$@"
