"""The layout planner: which (TP, PP, VP, DP, micro-batch, recomputation, distributed optimizer,
schedule) to run a model at on a cluster, by estimated step time and memory per GPU.

    cluster.py      the machine: GPUs per node, memory, peak, bandwidths; DGX presets
    layout.py       one candidate layout and the megapipe configs it stands for
    schedule_model  a schedule's bubble and micro-batches in flight (closed form or simulated)
    memory.py       bytes per GPU, from pipeline/stage_memory.MemoryModel
    time_model.py   step time: compute, bubble, TP / PP / DP communication
    search.py       enumerate, reject (with the reason), rank
    presets.py      GPT-3 sizes and the Megatron-LM weak-scaling models
    report.py       the tables tools/plan.py prints
"""
