#!/usr/bin/env bash
# The GPU check: everything CI cannot run, on a machine with CUDA GPUs and no network.
#
#   bash tools/gpu_check.sh                       # every part, one after the other
#   bash tools/gpu_check.sh --parts cuda-tests    # some parts (comma-separated), e.g. one per
#                                                 # command where a command may take 10 minutes
#
# Parts (each under its own `timeout`, every cap under 9 minutes on a cold cache; a part cut
# off by its cap is a TIMEOUT):
#   cuda-tests  every test that needs CUDA (`pytest -m cuda`: the conftest marks each test
#             skipped here for want of a CUDA device): every fused kernel (Triton, apex, TE)
#             against an fp64 reference in fp32, bf16 and fp16, forward and backward
#             (tests/test_kernels_cuda.py), the CUDA grad norm, the bf16 weight-gradient GEMM,
#             TE's CUDA cases where TE is installed, the async saver's device, the memory line
#   training  benchmarks/gpu_training_check.py: a small GPT trained with pretrain_gpt.py in
#             fp32, bf16 and fp16 (and TE bf16 / TE FP8 where TE is installed): losses fall and
#             stay within each precision's tolerance of fp32
#   mfu       benchmarks/bench_gpu_mfu.py: a ~1.3B GPT (24 x 2048, 16 heads, seq 2048, bf16,
#             flash attention, fused kernels) against a plain-PyTorch GPT of the same math
#   bench     benchmarks/bench_kernels.py: each fused op's speed-up over its reference
#   multi-gpu torchrun pretrain_gpt.py on 2 ranks, PP=2, NCCL, bf16, a tiny GPT with every
#             default pipeline flag (receives posted ahead, the start-up connections) and the
#             default dropout (0.1), with NCCL_DEBUG=INFO; a rank that has not finished after
#             60 s prints every thread's stack (SIGUSR2). Only with 2+ GPUs: NCCL refuses two
#             ranks on one GPU ("Duplicate GPU detected"), so with one GPU the part is skipped
#             and says so
#
# The caps are sized for a cold Triton cache (a fresh machine or container, ~/.triton/cache
# empty): every Triton kernel then compiles on first use, per dtype, forward and backward and
# per shape specialisation (LLVM + ptxas; estimated at ~1-3 s each, and CUDA start-up at
# ~5-10 s per pretrain_gpt.py process: not yet timed here, so the caps err long). cuda-tests
# compiles ~40 variants (3 dtypes x 7 kernels x forward/backward) after collecting the suite,
# training 3-5 runs that each compile their dtype's kernels, mfu and bench the bf16 kernels at
# their shapes, multi-gpu the same on two ranks at once; a warm rerun takes a fraction of each
# cap. Caps: cuda-tests 420, training 300, mfu 300, bench 180, multi-gpu 180 s.
#
# Writes the parts' logs and JSON to $GPU_CHECK_OUT (default benchmarks/out/gpu_check/), prints
# one summary table last and exits 1 if any part failed, 2 if there is no CUDA device (or an
# unknown part was asked for).
# Sourced (`source tools/gpu_check.sh`), it only defines its functions (tests/test_gpu_check.py).
# `bash tools/gpu_check.sh --multi-gpu-run gloo` runs the multi-gpu part's command on CPU ranks.
set -u -o pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${GPU_CHECK_OUT:-$ROOT/benchmarks/out/gpu_check}"
PYTHON="${PYTHON:-python}"

# gpu_count: the CUDA devices this process may use, as torch counts them (CUDA_VISIBLE_DEVICES
# applies; nvidia-smi is not needed and not consulted); 0 without CUDA or without torch.
gpu_count() {
    local count
    count="$("$PYTHON" -c "import torch; print(torch.cuda.device_count() \
if torch.cuda.is_available() else 0)" 2>/dev/null)" || count=0
    [[ "$count" =~ ^[0-9]+$ ]] || count=0
    echo "$count"
}

# multi_gpu_plan COUNT: "run" when COUNT GPUs can hold the 2-rank check, else the line that
# says why it is skipped.
multi_gpu_plan() {
    if [ "$1" -ge 2 ]; then
        echo "run"
    else
        echo "multi-gpu: skipped: $1 GPU(s) here, and NCCL refuses two ranks on one GPU" \
            "(\"Duplicate GPU detected\"); the 2-rank PP=2 NCCL check needs 2 GPUs"
    fi
}

# multi_gpu_run BACKEND [FLAGS...]: the 2-rank check, torchrun pretrain_gpt.py with PP=2 on
# BACKEND (nccl here; gloo for its CPU test) and a tiny GPT for 5 iterations with the default
# pipeline flags and dropout, plus FLAGS. Also `bash tools/gpu_check.sh --multi-gpu-run
# BACKEND [FLAGS...]`.
multi_gpu_run() {
    local backend="$1"
    shift
    "$PYTHON" -m torch.distributed.run --standalone --nproc_per_node 2 "$ROOT/pretrain_gpt.py" \
        --distributed-backend "$backend" --pipeline-model-parallel-size 2 \
        --num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 \
        --max-position-embeddings 64 --vocab-size 512 --micro-batch-size 1 \
        --global-batch-size 4 --train-iters 5 --lr 1e-3 --mock-data --eval-iters 0 \
        --log-interval 1 --seed 1234 "$@"
}

# descendants PID: every process below PID (children, grandchildren, ...), read from /proc.
descendants() {
    local status pid
    for status in /proc/[0-9]*/status; do
        pid="${status#/proc/}"
        pid="${pid%/status}"
        if [ "$(awk '/^PPid:/ {print $2}' "$status" 2>/dev/null)" = "$1" ]; then
            echo "$pid"
            descendants "$pid"
        fi
    done
}

# with_stack_dumps SECONDS COMMAND...: run COMMAND; if it has not finished after SECONDS, send
# SIGUSR2 to every process below it (pretrain_gpt.py prints every thread's stack on it) and say
# so, then wait for it; COMMAND's exit status.
with_stack_dumps() {
    local seconds="$1" pid waited=0
    shift
    "$@" &
    pid=$!
    while kill -0 "$pid" 2>/dev/null && [ "$waited" -lt "$seconds" ]; do
        sleep 1
        waited=$((waited + 1))
    done
    if kill -0 "$pid" 2>/dev/null; then
        echo "gpu_check: not finished after ${seconds} s: every rank's stacks follow (SIGUSR2)"
        for child in $(descendants "$pid"); do
            if grep -q pretrain_gpt "/proc/$child/cmdline" 2>/dev/null; then
                kill -USR2 "$child" 2>/dev/null
            fi
        done
    fi
    wait "$pid"
}

NAMES=() RESULTS=() SECONDS_TAKEN=() DETAILS=()

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

PARTS=(cuda-tests training mfu bench multi-gpu)

run_part() {
    local gpus="$2" plan
    case "$1" in
        cuda-tests)
            part cuda-tests 420 "$PYTHON" -m pytest -o addopts= -q -rfs -p no:cacheprovider \
                -m cuda tests
            DETAILS+=("$(grep -E '[0-9]+ (passed|failed|skipped|error)' "$OUT/cuda-tests.log" \
                | tail -n 1)")
            ;;
        training)
            part training 300 "$PYTHON" benchmarks/gpu_training_check.py \
                --json "$OUT/gpu_training_check.json"
            DETAILS+=("$(grep -E '^(bf16|fp16|te-bf16|te-fp8) ' "$OUT/training.log" \
                | awk '{print $1 " " $4 " vs fp32"}' | paste -sd ';' -)")
            ;;
        mfu)
            part mfu 300 "$PYTHON" benchmarks/bench_gpu_mfu.py --json "$OUT/gpu_mfu.json"
            DETAILS+=("$(grep -E '^(megapipe|plain)' "$OUT/mfu.log" \
                | awk '{print $1 " MFU " $(NF-1) " " $NF}' | paste -sd ';' -)")
            ;;
        bench)
            part bench 180 "$PYTHON" benchmarks/bench_kernels.py --impl triton,apex,te \
                --json "$OUT/kernels.json"
            DETAILS+=("speed-up per op: $OUT/bench.log")
            ;;
        multi-gpu)
            plan="$(multi_gpu_plan "$gpus")"
            if [ "$plan" = "run" ]; then
                NCCL_DEBUG=INFO part multi-gpu 180 bash -c "source '$ROOT/tools/gpu_check.sh' \
                    && with_stack_dumps 60 multi_gpu_run nccl --bf16"
                DETAILS+=("$(grep -oE 'iteration +[0-9]+/ +[0-9]+|lm loss: [0-9.E+-]+' \
                    "$OUT/multi-gpu.log" | tail -n 2 | paste -sd ' ' -)")
            else
                echo
                echo "$plan" | tee "$OUT/multi-gpu.log"
                NAMES+=("multi-gpu") RESULTS+=("skipped") SECONDS_TAKEN+=(0)
                DETAILS+=("needs 2 GPUs (NCCL refuses two ranks on one GPU)")
            fi
            ;;
    esac
}

# selected_parts [--parts A,B]: the parts to run, in PARTS' order; exits 2 naming an unknown one.
selected_parts() {
    local wanted=("${PARTS[@]}") name known
    if [ "${1:-}" = "--parts" ]; then
        IFS=, read -r -a wanted <<< "${2:-}"
    elif [ -n "${1:-}" ]; then
        echo "gpu_check: unknown argument $1 (--parts NAME[,NAME...] or nothing)" >&2
        return 2
    fi
    for name in "${wanted[@]}"; do
        known=0
        for part_name in "${PARTS[@]}"; do [ "$name" = "$part_name" ] && known=1; done
        if [ "$known" = 0 ]; then
            echo "gpu_check: unknown part '$name' (one of: ${PARTS[*]})" >&2
            return 2
        fi
    done
    echo "${wanted[@]}"
}

main() {
    cd "$ROOT" || exit 2
    local parts
    parts="$(selected_parts "$@")" || exit 2
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
    unset RANK WORLD_SIZE LOCAL_RANK TRITON_INTERPRET
    if ! "$PYTHON" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 3)" \
        2>/dev/null; then
        echo "gpu_check: no CUDA device here (torch.cuda.is_available() is False, or torch does" \
            "not import); this script needs a GPU. CI covers the rest: python -m pytest tests" >&2
        exit 2
    fi
    mkdir -p "$OUT" || exit 2
    local device gpus begin failed i name
    device="$("$PYTHON" -c "import torch; print(torch.cuda.get_device_name())")"
    gpus="$(gpu_count)"
    echo "gpu_check on $gpus x $device; parts: $parts; logs in $OUT"
    begin=$(date +%s)
    for name in $parts; do
        run_part "$name" "$gpus"
    done

    echo
    echo "=== gpu_check summary ($gpus x $device, $(($(date +%s) - begin)) s in all)"
    printf '%-10s %-12s %8s  %s\n' part result seconds detail
    failed=0
    for i in "${!NAMES[@]}"; do
        printf '%-10s %-12s %8s  %s\n' "${NAMES[$i]}" "${RESULTS[$i]}" "${SECONDS_TAKEN[$i]}" \
            "${DETAILS[$i]}"
        case "${RESULTS[$i]}" in ok | skipped) ;; *) failed=1 ;; esac
    done
    exit "$failed"
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
    if [ "${1:-}" = "--multi-gpu-run" ]; then # the multi-gpu part's command, alone
        shift
        multi_gpu_run "$@"
        exit
    fi
    main "$@"
fi
