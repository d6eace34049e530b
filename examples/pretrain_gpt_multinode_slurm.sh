#!/usr/bin/env bash
#SBATCH --job-name=megapipe-gpt
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=megapipe-%j.out
# GPT-3 1.3B-class pre-training on several DGX nodes with SLURM: one torchrun agent per node
# (srun starts one task per node), the agents meet through torchrun's c10d rendezvous on the
# first node. TP=2 stays inside a node (NVLink), PP=4, and DP = number of nodes x 8 / 8.
#
#   DATA_PATH=/data/my-gpt2_text_document VOCAB_FILE=/data/gpt2-vocab.json \
#   MERGE_FILE=/data/gpt2-merges.txt RUN_DIR=/shared/runs/gpt-1.3b \
#   sbatch --nodes 4 examples/pretrain_gpt_multinode_slurm.sh [extra pretrain_gpt.py flags]
#
# Submit from the megapipe checkout (sbatch runs a copy of this script, so the checkout is found
# from SLURM_SUBMIT_DIR; or set MEGAPIPE_DIR). RUN_DIR and the data must be on a file system
# every node sees. The rendezvous is tested on one host by tests/test_multinode.py.
set -euo pipefail

MEGAPIPE_DIR=${MEGAPIPE_DIR:-${SLURM_SUBMIT_DIR:-$(cd "$(dirname "$0")/.." && pwd)}}
DATA_PATH=${DATA_PATH:-/data/my-gpt2_text_document}
VOCAB_FILE=${VOCAB_FILE:-/data/gpt2-vocab.json}
MERGE_FILE=${MERGE_FILE:-/data/gpt2-merges.txt}
RUN_DIR=${RUN_DIR:-$MEGAPIPE_DIR/runs/gpt-1.3b-multinode}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
RDZV_PORT=${RDZV_PORT:-29500}
TRAIN_ITERS=${TRAIN_ITERS:-20000}

# ---- checks (on the first node; the others are alike under --exclusive): report all, exit 1 ----
missing=()
if [[ -z "${SLURM_JOB_ID:-}" || -z "${SLURM_NNODES:-}" || -z "${SLURM_JOB_NODELIST:-}" ]]; then
    missing+=("not inside a SLURM job (SLURM_JOB_ID/SLURM_NNODES/SLURM_JOB_NODELIST unset): submit with sbatch")
fi
for tool in srun scontrol; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool not found: this script needs SLURM")
done
if [[ -f "$MEGAPIPE_DIR/examples/lib/gpu_job_checks.sh" ]]; then
    # shellcheck source-path=SCRIPTDIR source=lib/gpu_job_checks.sh
    source "$MEGAPIPE_DIR/examples/lib/gpu_job_checks.sh"
else
    echo "$(basename "$0"): cannot start: $MEGAPIPE_DIR is not a megapipe checkout: submit from the megapipe checkout or set MEGAPIPE_DIR" >&2
    exit 1
fi
read -r -a data_words <<<"$DATA_PATH"
check_gpu_job "nodes" "submit from the megapipe checkout or set MEGAPIPE_DIR"
report_missing

# Attention dropout 0 keeps attention on SDPA's flash kernels: megapipe's layout-invariant
# attention dropout takes an explicit (unfused) path. Hidden dropout stays at Megatron's 0.1.
# ---- environment (srun passes it on to every node) ----
export CUDA_DEVICE_MAX_CONNECTIONS=1 # keeps TP/SP communication in issue order, as Megatron needs
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-8}
# export NCCL_DEBUG=INFO             # uncomment to see NCCL's topology and any hang's cause
# export NCCL_SOCKET_IFNAME=...      # the interface the nodes reach each other on, if not found

# Read the whole list (no `| head -n 1`: under pipefail, scontrol's SIGPIPE would end the job).
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
if ((${#nodes[@]} == 0)); then
    echo "$(basename "$0"): scontrol lists no hosts for SLURM_JOB_NODELIST=$SLURM_JOB_NODELIST" >&2
    exit 1
fi
HEAD=${nodes[0]}
echo "rendezvous: $HEAD:$RDZV_PORT, $SLURM_NNODES nodes x $GPUS_PER_NODE GPUs, job $SLURM_JOB_ID"
mkdir -p "$RUN_DIR"
cd "$MEGAPIPE_DIR"
srun --kill-on-bad-exit=1 torchrun \
    --nnodes "$SLURM_NNODES" --nproc_per_node "$GPUS_PER_NODE" \
    --rdzv-backend c10d --rdzv-endpoint "$HEAD:$RDZV_PORT" --rdzv-id "$SLURM_JOB_ID" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 4 \
    --num-layers 24 --hidden-size 2048 --num-attention-heads 16 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 2 --global-batch-size 512 \
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
