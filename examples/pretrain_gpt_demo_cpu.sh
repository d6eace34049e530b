#!/usr/bin/env bash
# The README's first command: train a small GPT on real English on a CPU machine, nothing
# downloaded. Builds a corpus from text that ships with Python, trains a SentencePiece
# tokenizer on it, preprocesses it into Megatron's .bin/.idx format, and trains with a 2-stage
# pipeline over 2 CPU ranks (gloo), evaluating on the validation split and writing TensorBoard
# logs to $RUN_DIR/tensorboard, then prints a greedy and a sampled continuation of "The".
# Override the run directory or rank count with
#   RUN_DIR=... NPROC=... bash examples/pretrain_gpt_demo_cpu.sh [extra pretrain_gpt.py flags]
set -euo pipefail
cd "$(dirname "$0")/.."
RUN_DIR=${RUN_DIR:-runs/demo}
NPROC=${NPROC:-2}
mkdir -p "$RUN_DIR"

python tools/make_demo_corpus.py --output "$RUN_DIR/corpus.jsonl"
python tools/train_tokenizer.py --input "$RUN_DIR/corpus.jsonl" --output-prefix "$RUN_DIR/tok" \
    --vocab-size 2000
python tools/preprocess_data.py --input "$RUN_DIR/corpus.jsonl" \
    --output-prefix "$RUN_DIR/corpus" --tokenizer-type GPTSentencePieceTokenizer \
    --tokenizer-model "$RUN_DIR/tok.model" --append-eod --workers 2

OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node "$NPROC" pretrain_gpt.py \
    --pipeline-model-parallel-size 2 --num-layers 2 --hidden-size 128 \
    --num-attention-heads 4 --seq-length 64 --max-position-embeddings 64 \
    --micro-batch-size 4 --global-batch-size 16 --train-iters 800 --lr 1e-2 --adam-beta2 0.95 \
    --lr-decay-style cosine --lr-warmup-iters 30 --min-lr 1e-3 --log-interval 100 \
    --attention-dropout 0.0 --hidden-dropout 0.0 \
    --data-path "$RUN_DIR/corpus_text_document" --split 98,2,0 \
    --tokenizer-type GPTSentencePieceTokenizer --tokenizer-model "$RUN_DIR/tok.model" \
    --data-cache-path "$RUN_DIR/cache" \
    --eval-interval 400 --eval-iters 2 --log-throughput --tensorboard-dir "$RUN_DIR/tensorboard" \
    --save "$RUN_DIR/checkpoints" --save-interval 400 "$@"

# What the model writes now, from the checkpoint just saved, on one process: greedy, then
# sampled from the 20 likeliest tokens. 800 iterations of a 2-layer model (about 40 s) teach it
# common words and phrases, not sentences; more --train-iters write better.
export OMP_NUM_THREADS=1
python tools/generate_text.py --load "$RUN_DIR/checkpoints" --greedy --max-new-tokens 24 \
    --prompt "The"
python tools/generate_text.py --load "$RUN_DIR/checkpoints" --top-k 20 --seed 1 \
    --max-new-tokens 24 --prompt "The"

echo "why the last iteration shows two validation losses: one is the evaluation every --eval-interval" \
    "iterations, the other Megatron's end-of-training evaluation, which reads the next" \
    "--eval-iters batches of the validation split (new samples, so a different number)"
echo "view the TensorBoard logs with: tensorboard --logdir $RUN_DIR/tensorboard"
echo "checkpoints in $RUN_DIR/checkpoints: continue with this script and" \
    "--load $RUN_DIR/checkpoints --train-iters 1600 --use-checkpoint-opt_param-scheduler" \
    "(at any layout, e.g. NPROC=4 ... --tensor-model-parallel-size 2). The longer run changes" \
    "the LR schedule, so say which one to follow: --use-checkpoint-opt_param-scheduler keeps" \
    "the saved one (past iteration 800 the LR stays at --min-lr), --override-opt_param-scheduler" \
    "takes the new one (a cosine over 1600 iterations: the LR rises again); without either" \
    "the run stops with one line naming both"
