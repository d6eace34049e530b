"""The layout planner: which (TP, PP, VP, DP, micro-batch, recomputation, data-parallel sharding
(plain, ZeRO-1/2/3), schedule, CP, and EP for mixtures of experts) to run a model at on a
cluster, by estimated step time and memory per GPU, and whether sharded data parallelism beats
model parallelism there.

    cluster.py      the machine: GPUs per node, memory, peak, bandwidths; DGX presets
    layout.py       one candidate layout and the megapipe configs it stands for
    schedule_model  a schedule's bubble and micro-batches in flight (closed form or simulated)
    memory.py       bytes per GPU, from pipeline/stage_memory.MemoryModel
    time_model.py   step time: compute, bubble, TP / PP / DP (all-gather, reduce-scatter)
    expert_time.py  mixtures of experts: the EP token exchange, the experts' TP traffic
    search.py       enumerate, reject (with the reason), rank
    presets.py      GPT-3 sizes, the Megatron-LM weak-scaling models, Mixtral 8x7B / 8x22B
    report.py       the tables tools/plan.py prints, the sharded-DP verdict
"""
