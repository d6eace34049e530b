#!/usr/bin/env bash
# GPT-3 1.3B-class pre-training on one DGX node (8 GPUs): TP=2 x PP=4 (DP=1), bf16, the
# distributed optimizer, throughput in the log line, TensorBoard, evaluation and checkpoints.
#
#   DATA_PATH=/data/my-gpt2_text_document VOCAB_FILE=/data/gpt2-vocab.json \
#   MERGE_FILE=/data/gpt2-merges.txt RUN_DIR=/data/runs/gpt-1.3b \
#   bash examples/pretrain_gpt_dgx_1node.sh [extra pretrain_gpt.py flags]
#
# DATA_PATH is what --data-path takes: one prefix (PREFIX.bin + PREFIX.idx, written by
# tools/preprocess_data.py with --tokenizer-type GPT2BPETokenizer) or a blend "0.3 A 0.7 B".
# Before anything starts, the script checks the GPUs and every file, and names what is missing.
set -euo pipefail

MEGAPIPE_DIR=${MEGAPIPE_DIR:-$(cd "$(dirname "$0")/.." && pwd)}
DATA_PATH=${DATA_PATH:-/data/my-gpt2_text_document}
VOCAB_FILE=${VOCAB_FILE:-/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-/data/gpt2-merges.txt}
RUN_DIR=${RUN_DIR:-$MEGAPIPE_DIR/runs/gpt-1.3b}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
TRAIN_ITERS=${TRAIN_ITERS:-20000}

# ---- checks: collect every problem, report them all, exit 1 ----
missing=()
if [[ -f "$MEGAPIPE_DIR/examples/lib/gpu_job_checks.sh" ]]; then
    # shellcheck source-path=SCRIPTDIR source=lib/gpu_job_checks.sh
    source "$MEGAPIPE_DIR/examples/lib/gpu_job_checks.sh"
else
    echo "$(basename "$0"): cannot start: $MEGAPIPE_DIR is not a megapipe checkout: set MEGAPIPE_DIR to the megapipe checkout" >&2
    exit 1
fi
read -r -a data_words <<<"$DATA_PATH"
check_gpu_job "a node" "set MEGAPIPE_DIR to the megapipe checkout"
report_missing

# Attention dropout 0 keeps attention on SDPA's flash kernels: megapipe's layout-invariant
# attention dropout takes an explicit (unfused) path. Hidden dropout stays at Megatron's 0.1.
# ---- environment ----
export CUDA_DEVICE_MAX_CONNECTIONS=1 # keeps TP/SP communication in issue order, as Megatron needs
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# export NCCL_DEBUG=INFO             # uncomment to see NCCL's topology and any hang's cause

mkdir -p "$RUN_DIR"
cd "$MEGAPIPE_DIR"
torchrun --standalone --nproc_per_node "$GPUS_PER_NODE" pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 2 --global-batch-size 256 \
    --train-iters "$TRAIN_ITERS" --lr 2.0e-4 --min-lr 2.0e-5 --lr-decay-style cosine \
    --lr-decay-iters "$TRAIN_ITERS" --lr-warmup-fraction 0.01 \
    --weight-decay 0.1 --adam-beta1 0.9 --adam-beta2 0.95 --init-method-std 0.02 \
    --clip-grad 1.0 --attention-dropout 0.0 --hidden-dropout 0.1 \
    --bf16 --use-distributed-optimizer --overlap-grad-reduce \
    --tokenizer-type GPT2BPETokenizer --vocab-file "$VOCAB_FILE" --merge-file "$MERGE_FILE" \
    --data-path "${data_words[@]}" --split 949,50,1 --data-cache-path "$RUN_DIR/cache" \
    --log-interval 10 --log-throughput \
    --eval-interval 1000 --eval-iters 10 \
    --save "$RUN_DIR/checkpoints" --load "$RUN_DIR/checkpoints" --save-interval 1000 \
    --tensorboard-dir "$RUN_DIR/tensorboard" "$@"

echo "TensorBoard logs: $RUN_DIR/tensorboard  (view: tensorboard --logdir $RUN_DIR/tensorboard)"
