# shellcheck shell=bash
# Checks shared by the GPU example scripts: source it, then call
#   check_gpu_job "a node" "set MEGAPIPE_DIR to the megapipe checkout"
# after setting GPUS_PER_NODE, MEGAPIPE_DIR, VOCAB_FILE, MERGE_FILE and DATA_PATH. Every problem
# found is appended to the caller's `missing` array, so the script can report them all at once.

check_gpu_job() {
    local nodes=$1 megapipe_hint=$2 gpu_list gpus word ext data_words
    if ! command -v nvidia-smi >/dev/null 2>&1; then
        missing+=("nvidia-smi not found: this script needs $nodes with $GPUS_PER_NODE NVIDIA GPUs")
    elif ! gpu_list=$(nvidia-smi --list-gpus 2>&1); then
        missing+=("nvidia-smi failed: ${gpu_list%%$'\n'*}")
    else
        gpus=$(grep -c '^GPU ' <<<"$gpu_list" || true)
        if ((gpus < GPUS_PER_NODE)); then
            missing+=("found $gpus GPUs, need $GPUS_PER_NODE (set GPUS_PER_NODE, and the layout, to match)")
        fi
    fi
    command -v torchrun >/dev/null 2>&1 || missing+=("torchrun not found: install PyTorch")
    [[ -f "$MEGAPIPE_DIR/pretrain_gpt.py" ]] ||
        missing+=("$MEGAPIPE_DIR/pretrain_gpt.py not found: $megapipe_hint")
    [[ -f "$VOCAB_FILE" ]] || missing+=("vocab file VOCAB_FILE=$VOCAB_FILE not found (GPT-2 vocab.json)")
    [[ -f "$MERGE_FILE" ]] || missing+=("merge file MERGE_FILE=$MERGE_FILE not found (GPT-2 merges.txt)")
    read -r -a data_words <<<"$DATA_PATH"
    for word in "${data_words[@]}"; do
        [[ "$word" =~ ^[0-9.eE+-]+$ ]] && continue # a blend weight, not a prefix
        for ext in bin idx; do
            [[ -f "$word.$ext" ]] || missing+=("data file $word.$ext not found (DATA_PATH=$DATA_PATH)")
        done
    done
}

# Print every collected problem and exit 1, or return when there is none.
report_missing() {
    if ((${#missing[@]})); then
        echo "$(basename "$0"): cannot start:" >&2
        printf '  - %s\n' "${missing[@]}" >&2
        exit 1
    fi
}
