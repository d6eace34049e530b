#!/usr/bin/env bash
# The GPU check: everything CI cannot run, on a machine with one CUDA GPU and no network.
#
#   bash tools/gpu_check.sh            # from anywhere; not yet timed on a GPU (caps: 370 s)
#
# Parts (each under its own `timeout`; the caps add up to 370 s, about 6 minutes, and the parts
# should take 4-5; a part cut off by its cap is a TIMEOUT, and a rerun finds Triton's cache warm):
#   kernels   tests/test_kernels_cuda.py: every fused kernel (Triton, apex, TE) against an fp64
#             reference in fp32, bf16 and fp16, forward and backward (a NaN never passes); plus
#             tests/test_transformer_engine.py (its TE cases run when TE is installed)
#   training  benchmarks/gpu_training_check.py: a small GPT trained with pretrain_gpt.py in
#             fp32, bf16 and fp16 (and TE bf16 / TE FP8 where TE is installed): losses fall and
#             stay within each precision's tolerance of fp32
#   mfu       benchmarks/bench_gpu_mfu.py: a ~1.3B GPT (24 x 2048, 16 heads, seq 2048, bf16,
#             flash attention, fused kernels) against a plain-PyTorch GPT of the same math
#   bench     benchmarks/bench_kernels.py: each fused op's speed-up over its reference
#
# Writes the parts' logs and JSON to $GPU_CHECK_OUT (default benchmarks/out/gpu_check/), prints
# one summary table last and exits 1 if any part failed, 2 if there is no CUDA device.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${GPU_CHECK_OUT:-$ROOT/benchmarks/out/gpu_check}"
PYTHON="${PYTHON:-python}"
cd "$ROOT" || exit 2
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
unset RANK WORLD_SIZE LOCAL_RANK TRITON_INTERPRET

if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" \
    2>/dev/null; then
    echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False, or torch does not" \
        "import); this script needs one GPU. CI covers the rest: python -m pytest tests" >&2
    exit 2
fi
mkdir -p "$OUT" || exit 2
DEVICE="$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name())")"
echo "gpu_check on $DEVICE; logs in $OUT"

NAMES=() RESULTS=() SECONDS_TAKEN=() DETAILS=()
BEGIN=$(date +%s)

# part NAME CAP_SECONDS COMMAND...: run one part under `timeout`, its output to the screen and
# to $OUT/NAME.log; record ok / FAIL (exit status) / TIMEOUT.
part() {
    local name="$1" cap="$2" start status result
    shift 2
    echo
    echo "=== $name (at most ${cap} s): $*"
    start=$(date +%s)
    timeout --kill-after=10 "$cap" "$@" 2>&1 | tee "$OUT/$name.log"
    status=${PIPESTATUS[0]}
    case "$status" in
        0) result="ok" ;;
        124 | 137) result="TIMEOUT" ;;
        *) result="FAIL ($status)" ;;
    esac
    NAMES+=("$name") RESULTS+=("$result") SECONDS_TAKEN+=("$(($(date +%s) - start))")
}

part kernels 110 "$PYTHON" -m pytest -o addopts= -q -rfs -p no:cacheprovider \
    tests/test_kernels_cuda.py tests/test_transformer_engine.py
DETAILS+=("$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/kernels.log" | tail -n 1)")

part training 100 "$PYTHON" benchmarks/gpu_training_check.py --json "$OUT/gpu_training_check.json"
DETAILS+=("$(grep -E '^(bf16|fp16|te-bf16|te-fp8) ' "$OUT/training.log" | awk '{print $1 " " $4 " vs fp32"}' | paste -sd ';' -)")

part mfu 120 "$PYTHON" benchmarks/bench_gpu_mfu.py --json "$OUT/gpu_mfu.json"
DETAILS+=("$(grep -E '^(megapipe|plain)' "$OUT/mfu.log" | awk '{print $1 " MFU " $(NF-1) " " $NF}' | paste -sd ';' -)")

part bench 40 "$PYTHON" benchmarks/bench_kernels.py --impl triton,apex,te \
    --json "$OUT/kernels.json"
DETAILS+=("speed-up per op: $OUT/bench.log")

echo
echo "=== gpu_check summary ($DEVICE, $(($(date +%s) - BEGIN)) s in all)"
printf '%-9s %-12s %8s  %s\n' part result seconds detail
failed=0
for i in "${!NAMES[@]}"; do
    printf '%-9s %-12s %8s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" "${DETAILS[$i]}"
    [ "${RESULTS[$i]}" = "ok" ] || failed=1
done
exit "$failed"
