#!/bin/bash
# Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh, unchanged but for sizes, on 4 CPU
# ranks (TP=2 x PP=2, gloo). Every flag of the original is here; run with the original's five
# arguments:
#   bash examples/train_gpt3_175b_distributed_cpu.sh CHECKPOINT_PATH TENSORBOARD_LOGS_PATH \
#       VOCAB_FILE MERGE_FILE DATA_PATH
# Sizes changed: 4 ranks (was 8 GPUs), 4 layers / hidden 32 / 4 heads / seq 32 (was 96 / 12288 /
# 96 / 2048), global batch 8 with a ramp-up 2 2 24 (was 1536, 16 16 5859375), 24 iterations
# (was 500000) with decay over 20 (was 430000), TP 2 x PP 2 (was 8 x 16), log/eval/save
# intervals and eval iterations scaled to the run. With --fp16 and Megatron's initial loss scale
# of 2^32 the first iterations overflow and are skipped, as in Megatron. MASTER_PORT may be set from the environment (tests pick a free
# one); OMP_NUM_THREADS=1 keeps the CPU ranks from oversubscribing the cores.

export CUDA_DEVICE_MAX_CONNECTIONS=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

GPUS_PER_NODE=4
# Change for multinode config
MASTER_ADDR=localhost
MASTER_PORT=${MASTER_PORT:-6000}
NUM_NODES=1
NODE_RANK=0
WORLD_SIZE=$(($GPUS_PER_NODE*$NUM_NODES))

CHECKPOINT_PATH=$1 #<Specify path>
TENSORBOARD_LOGS_PATH=$2 #<Specify path>
VOCAB_FILE=$3 #<Specify path to file>/gpt2-vocab.json
MERGE_FILE=$4 #<Specify path to file>/gpt2-merges.txt
DATA_PATH=$5 #<Specify path and file prefix>_text_document

if [ "$#" -ne 5 ]; then
    echo "usage: $0 CHECKPOINT_PATH TENSORBOARD_LOGS_PATH VOCAB_FILE MERGE_FILE DATA_PATH" >&2
    exit 2
fi

DISTRIBUTED_ARGS=(
    --nproc_per_node $GPUS_PER_NODE 
    --nnodes $NUM_NODES 
    --master_addr $MASTER_ADDR 
    --master_port $MASTER_PORT
)

GPT_MODEL_ARGS=(
    --num-layers 4 
    --hidden-size 32 
    --num-attention-heads 4 
    --seq-length 32 
    --max-position-embeddings 32 
    --attention-backend auto # Can use (flash/fused/unfused/local)
)

TRAINING_ARGS=(
    --micro-batch-size 1 
    --global-batch-size 8 
    --rampup-batch-size 2 2 24 
    --train-iters 24 
    --weight-decay 0.1 
    --adam-beta1 0.9 
    --adam-beta2 0.95 
    --init-method-std 0.006 
    --clip-grad 1.0 
    --fp16
    --lr 6.0e-4 
    --lr-decay-style cosine 
    --min-lr 6.0e-5
    --lr-warmup-fraction .001 
    --lr-decay-iters 20 
)

MODEL_PARALLEL_ARGS=(
	--tensor-model-parallel-size 2 
	--pipeline-model-parallel-size 2 
)

DATA_ARGS=(
    --data-path $DATA_PATH 
    --vocab-file $VOCAB_FILE 
    --merge-file $MERGE_FILE 
    --split 949,50,1
)

EVAL_AND_LOGGING_ARGS=(
    --log-interval 6
    --save-interval 12 
    --eval-interval 12 
    --save $CHECKPOINT_PATH 
    --load $CHECKPOINT_PATH 
    --eval-iters 1
    --tensorboard-dir $TENSORBOARD_LOGS_PATH 
)

cd "$(dirname "$0")/.."
torchrun ${DISTRIBUTED_ARGS[@]} pretrain_gpt.py \
    ${GPT_MODEL_ARGS[@]} \
    ${TRAINING_ARGS[@]} \
    ${MODEL_PARALLEL_ARGS[@]} \
    ${DATA_ARGS[@]} \
    ${EVAL_AND_LOGGING_ARGS[@]}
