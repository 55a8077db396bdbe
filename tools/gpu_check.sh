#!/usr/bin/env bash
# Issue 24's one device run: the CUDA/NCCL path tested and measured on one GPU, in well under 8 minutes.
#
#     bash tools/gpu_check.sh                  # on the GPU machine, from the repository root
#     GPU_CHECK_QUICK=1 bash tools/gpu_check.sh   # a CPU smoke run of every step's command line (tiny sizes)
#
# Everything goes under $OUT (default ./gpu_out): one log per step (NN_name.log), the JSON/JSONL the steps
# write, and summary.txt (each step's exit status and seconds, then the lines worth reading). Every step has
# its own timeout, so one failing or hanging step does not stop the others; the script itself exits 0.
#   00 env        nvidia-smi, torch version, CUDA availability (a CPU-only torch: pip install torch==2.13.0)
#   01 tests      pytest tests/cuda (CUDA tests: NCCL at world size 1, 2 gloo ranks sharing the GPU)    180 s max
#   02 pretrain   pretrain_gpt.py --model-preset gpt2-125m --bf16, mock data, GPT-2 vocabulary          75 s max
#   03 pretrain   the same with --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather 75 s max
#   04 overhead   benchmarks.ddp_overhead_gpt: bare GPT-2 125M step vs wrapped, bf16                    60 s max
#   05 offload    benchmarks.optimizer_offload: device memory saved and step time, offload 1.0 / 0.5    60 s max
#   06 calibrate  benchmarks.perf_model_calibrate --world-size 1 (NCCL)                                  60 s max
#   07 pretrain   02 with --torch-compile (per-layer torch.compile)                                     150 s max
#   08 pretrain   07 with the whole batch in one micro-batch of 32                                       150 s max
#   09 overhead   04 with every variant compiled (--compile)                                             150 s max
#   10 determinism  ZeRO-3 gpt2-125m 20 iterations: normal build twice, with --deterministic-mode twice and
#                 meta-device built with it once; the five run side by side                               120 s max
# (00 env 60 s max: 1080 s in all at worst; the device lends 10 minutes per command: choose steps with
#  GPU_CHECK_STEPS="00 07 08", the step numbers to run, space-separated; default all.)
set -u
cd "$(dirname "$0")/.."
OUT="${OUT:-./gpu_out}"
mkdir -p "$OUT"
SUMMARY="$OUT/summary.txt"
: > "$SUMMARY"
QUICK="${GPU_CHECK_QUICK:-0}"
PY="${PYTHON:-python}"
export PYTHONUNBUFFERED=1

step() {  # step NAME TIMEOUT_S COMMAND...: run, log, record status and time (skipped unless GPU_CHECK_STEPS has it)
    local name="$1" limit="$2"
    shift 2
    case " ${GPU_CHECK_STEPS:-${name%%_*}} " in *" ${name%%_*} "*) ;; *) return 0 ;; esac
    local log="$OUT/$name.log" start end rc
    start=$(date +%s)
    echo "=== $name (timeout ${limit}s): $*" | tee -a "$SUMMARY"
    { echo "+ $*"; timeout --kill-after=10 "$limit" "$@"; } > "$log" 2>&1
    rc=$?
    end=$(date +%s)
    echo "    rc=$rc$([ $rc -eq 124 ] || [ $rc -eq 137 ] && echo ' (TIMED OUT)') in $((end - start)) s -> $log" \
        | tee -a "$SUMMARY"
    return 0
}

# ---------------------------------------------------------------- 00 environment
step 00_env 60 bash -c "
    nvidia-smi || echo 'nvidia-smi: not available'
    $PY -c 'import torch, sys; print(\"python\", sys.version.split()[0]); print(\"torch\", torch.__version__, \"cuda build\", torch.version.cuda); print(\"cuda available\", torch.cuda.is_available()); print(\"devices\", [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]); print(\"nccl\", torch.cuda.nccl.version() if torch.cuda.is_available() else None); print(\"bf16 supported\", torch.cuda.is_available() and torch.cuda.is_bf16_supported())'
"
CUDA_OK=$($PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
if [ "$CUDA_OK" != 1 ] && [ "$QUICK" != 1 ] && command -v nvidia-smi > /dev/null; then
    # A GPU but a CPU-only torch: the CUDA build of the same version, nothing else.
    step 00_pip_install_torch 240 $PY -m pip install torch==2.13.0
    CUDA_OK=$($PY -c 'import torch; print(int(torch.cuda.is_available()))' 2>/dev/null || echo 0)
    $PY -c 'import torch; print("after pip: torch", torch.__version__, "cuda available", torch.cuda.is_available())' \
        >> "$SUMMARY" 2>&1
fi
echo "cuda available: $CUDA_OK" | tee -a "$SUMMARY"

if [ "$QUICK" = 1 ]; then  # CPU smoke sizes: the same command lines, tiny and short
    DEV=cpu
    PRETRAIN_SIZE=(--model-preset tiny --train-iters 4 --log-interval 2 --micro-batch-size 2 --global-batch-size 4
                   --seq-length 64 --vocab-size 512)
    OVERHEAD_SIZE=(--quick)
    OFFLOAD_SIZE=(--quick)
    CALIBRATE_SIZE=(--num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 32 --vocab-size 512
                    --reps 2 --steps 2 --repeats 1)
    export MLITE_CUDA_TESTS_ON_CPU=1  # tests/cuda checks its own logic on the CPU
else
    DEV=cuda
    # GPT-2 125M (12 x 768, 12 heads, seq 1024, GPT-2's vocabulary padded to 50304): 32k tokens per iteration
    # in 2 micro-batches of 16. ~100-250k tokens/s expected on an H100 in eager bf16: 200 iterations take
    # 25-65 s; the timeout keeps whatever was logged if it is slower.
    PRETRAIN_SIZE=(--model-preset gpt2-125m --train-iters 100 --log-interval 20 --micro-batch-size 16
                   --global-batch-size 32 --seq-length 1024 --vocab-size 50304)
    OVERHEAD_SIZE=(--micro-batch 8 --repeats 10 --steps 3)
    OFFLOAD_SIZE=()
    CALIBRATE_SIZE=()
fi

# ---------------------------------------------------------------- 01 the CUDA tests
step 01_tests_cuda 180 $PY -m pytest -q -p no:cacheprovider -rfEs tests/cuda

# ---------------------------------------------------------------- 02/03 pretrain_gpt.py: tokens/s and MFU
COMMON=(--bf16 --mock-data --tokenizer-type NullTokenizer --eval-iters 0 --device "$DEV" "${PRETRAIN_SIZE[@]}")
step 02_pretrain_gpt2_125m_bf16 75 $PY pretrain_gpt.py "${COMMON[@]}" --metrics-file "$OUT/02_metrics.jsonl"
step 03_pretrain_gpt2_125m_bf16_distopt_overlap 75 $PY pretrain_gpt.py "${COMMON[@]}" --use-distributed-optimizer \
    --overlap-grad-reduce --overlap-param-gather --metrics-file "$OUT/03_metrics.jsonl"

# ---------------------------------------------------------------- 04 the wrapper's overhead on the GPU
step 04_ddp_overhead_gpt2_125m_bf16 60 $PY -m benchmarks.ddp_overhead_gpt --device "$DEV" --dtype bf16 \
    "${OVERHEAD_SIZE[@]}" --out "$OUT/04_ddp_overhead.json"

# ---------------------------------------------------------------- 05 optimizer CPU offload: memory and time
step 05_optimizer_offload_gpt2_125m_bf16 60 $PY -m benchmarks.optimizer_offload --device "$DEV" \
    "${OFFLOAD_SIZE[@]}" --out "$OUT/05_optimizer_offload.json"

# ---------------------------------------------------------------- 06 perf model calibration with NCCL
CAL_DEV=()
[ "$DEV" = cpu ] && CAL_DEV=(--cpu)
step 06_perf_model_calibrate_nccl 60 $PY -m benchmarks.perf_model_calibrate --world-size 1 "${CAL_DEV[@]}" \
    "${CALIBRATE_SIZE[@]}" --out "$OUT/06_perf_model_dp1.json"

# ---------------------------------------------------------------- 07/08/09 compiled: tokens/s, MFU, overhead
step 07_pretrain_gpt2_125m_bf16_compile 150 $PY pretrain_gpt.py "${COMMON[@]}" --torch-compile \
    --metrics-file "$OUT/07_metrics.jsonl"
step 08_pretrain_gpt2_125m_bf16_compile_mbs32 150 $PY pretrain_gpt.py "${COMMON[@]}" --torch-compile \
    --micro-batch-size "${MBS_ALL:-32}" --metrics-file "$OUT/08_metrics.jsonl"
step 09_ddp_overhead_gpt2_125m_bf16_compile 150 $PY -m benchmarks.ddp_overhead_gpt --device "$DEV" --dtype bf16 \
    "${OVERHEAD_SIZE[@]}" --compile --out "$OUT/09_ddp_overhead_compile.json"

# ---------------------------------------------------------------- 10 reproducibility of the meta-device build
# Is the meta build's loss difference on CUDA (issue 21) CUDA's nondeterminism or a real difference?
DET=(--model-preset gpt2-125m --bf16 --mock-data --tokenizer-type NullTokenizer --eval-iters 0 --device "$DEV"
     --use-distributed-optimizer --data-parallel-sharding-strategy optim_grads_params --overlap-grad-reduce
     --overlap-param-gather --train-iters 20 --log-interval 1 --micro-batch-size 4 --global-batch-size 8
     --seq-length 1024 --vocab-size 50304)
[ "$QUICK" = 1 ] && DET=("${DET[@]}" --num-layers 2 --hidden-size 64 --num-attention-heads 2 --seq-length 64
                        --vocab-size 512 --train-iters 4)
RUNS=("normal_a" "normal_b" "det_normal_a --deterministic-mode" "det_normal_b --deterministic-mode"
      "det_meta --deterministic-mode --init-model-with-meta-device")
{
    for run in "${RUNS[@]}"; do
        set -- $run
        name=$1; shift
        echo "$PY pretrain_gpt.py ${DET[*]} $* --metrics-file $OUT/10_$name.jsonl > $OUT/10_$name.log 2>&1 &"
    done
    echo "wait"
    # Per run: the lm loss of every iteration (metrics JSONL), and which runs agree bitwise.
    echo "$PY - $OUT/10_*.jsonl <<'PYEOF'"
    cat <<'PYEOF'
import json, sys
runs = {}
for path in sys.argv[1:]:
    rows = [json.loads(line) for line in open(path)]
    runs[path.rsplit("/", 1)[-1][3:-6]] = [r["lm_loss"] for r in rows if "lm_loss" in r]
for name, losses in runs.items():
    print(f"{name:14s} {len(losses):3d} iterations, last {losses[-1] if losses else None!r}")
names = list(runs)
for i, a in enumerate(names):
    for b in names[i + 1:]:
        same = runs[a] == runs[b]
        first = next((k for k, (x, y) in enumerate(zip(runs[a], runs[b])) if x != y), None)
        where = f"differ from iteration {first + 1}" if first is not None else "differ in length"
        print(f"{a} vs {b}: {'bitwise equal' if same else where}")
PYEOF
    echo "PYEOF"
} > "$OUT/10_determinism.sh"
step 10_determinism 120 bash "$OUT/10_determinism.sh"
for f in "$OUT"/10_*_*.log; do grep -E "Error|Traceback" "$f" | head -n 3 | sed "s|^|$(basename "$f"): |"; done \
    >> "$OUT/10_determinism.log" 2>&1

# ---------------------------------------------------------------- summary: the lines worth reading
{
    echo
    echo "--- 00 env"; grep -E "^(python|torch|cuda available|devices|nccl|bf16)" "$OUT/00_env.log"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null
    echo "--- 01 tests"; tail -n 25 "$OUT/01_tests_cuda.log"
    for f in "$OUT"/0[2378]_*.log; do
        echo "--- $(basename "$f"): parameters and the last log lines"
        grep -E "parameters \|" "$f"
        grep -E "iteration +[0-9]+/" "$f" | tail -n 3 | sed -E 's/\| learning rate.*\| lm loss/| lm loss/'
        grep -E "Error|error|Traceback" "$f" | head -n 5
    done
    echo "--- 04 overhead"; tail -n 6 "$OUT/04_ddp_overhead_gpt2_125m_bf16.log"
    echo "--- 05 offload"; tail -n 5 "$OUT/05_optimizer_offload_gpt2_125m_bf16.log"
    echo "--- 06 calibrate"; tail -n 3 "$OUT/06_perf_model_calibrate_nccl.log"
    echo "--- 09 overhead, compiled"; tail -n 6 "$OUT/09_ddp_overhead_gpt2_125m_bf16_compile.log"
    echo "--- 10 determinism"; cat "$OUT/10_determinism.log"
} >> "$SUMMARY" 2>&1
echo "summary: $SUMMARY"
sed -n "/^--- 00 env/,\$p" "$SUMMARY"
# The device tool returns at most 8 files from $OUT: everything but the summary goes into one archive.
if [ "${GPU_CHECK_PACK:-1}" = 1 ]; then
    tar -C "$OUT" -czf "$OUT/../gpu_check_logs.tgz" --exclude=summary.txt . \
        && find "$OUT" -type f ! -name summary.txt -delete && mv "$OUT/../gpu_check_logs.tgz" "$OUT/logs.tgz"
fi
exit 0
