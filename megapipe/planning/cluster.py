"""The machine a plan is for: GPUs per node, nodes, memory per GPU, peak and bandwidths.

Bandwidths are per GPU and per direction, in GB/s (1e9 bytes/s), as a ring collective sees
them: NVLink's data-sheet figure is both directions together (A100 600 GB/s -> 300 each way),
and a DGX gives each GPU its own InfiniBand adapter (8x200 Gb/s -> 25 GB/s per GPU). The
presets use the data-sheet numbers as they are (no derating for protocol overheads): the
matmul efficiency below is the one calibrated knob.

Every collective and pipeline send also pays a fixed `collective_latency_us` (the alpha of an
alpha-beta model), whatever its size. The presets take NCCL's: a ring all-reduce of a few bytes
over the 8 GPUs of a DGX A100 measured 33.7 us in nccl-tests (NVIDIA/nccl-tests issue 123);
inter-node collectives take longer, which is not modelled. On a CPU with gloo it is the term
that matters: bench_planner.py measures it (2.6-3.0 ms for an activation-sized all-reduce
after compute, beyond the 0.25 ms its bytes take; back to back it takes 0.66 ms in all).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from megapipe.training.flops import device_peak_tflops

GIB = 1024.0**3

# The matmul efficiency (achievable fraction of the dense peak) of the GPU presets, calibrated
# on the first row of Megatron-LM's weak-scaling table (GPT 1.7B on 32 A100s, TP1 PP1 DP32,
# 137 TFLOP/s per GPU): benchmarks/bench_planner.py --published recomputes it.
GPU_MATMUL_EFFICIENCY = 0.48
NCCL_LATENCY_US = 30.0  # about nccl-tests' 8-GPU small all-reduce on a DGX A100 (33.7 us)


@dataclass(frozen=True)
class Cluster:
    """GPUs per node x nodes, each with `memory_bytes` and `peak_tflops` (dense, the training
    dtype); `matmul_efficiency` of that peak is what the model's matmuls achieve."""

    name: str
    gpus_per_node: int
    nodes: int
    memory_bytes: float
    peak_tflops: float
    intra_node_gbps: float  # per GPU, per direction (NVLink)
    inter_node_gbps: float  # per GPU, per direction (InfiniBand)
    matmul_efficiency: float = GPU_MATMUL_EFFICIENCY
    collective_latency_us: float = NCCL_LATENCY_US  # fixed cost of each collective or send
    # Device memory bandwidth (GB/s): what FSDP2's copies into and out of its flat collective
    # buffers cost (ZeRO-2/3); None leaves them out
    memory_gbps: float | None = None
    # The fraction of the ring bandwidth a reduce-scatter or all-gather achieves against an
    # all-reduce's (ZeRO-1/2/3's collectives): 1 assumed on NCCL (not measured here); gloo's
    # reached 0.41-0.68 on this CPU (benchmarks/bench_planner.py measures it)
    shard_collective_efficiency: float = 1.0

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def with_(self, **changes: object) -> Cluster:
        """A copy with some fields changed (nodes, memory, ...)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        return (
            f"{self.name}: {self.nodes} node(s) x {self.gpus_per_node} GPUs, "
            f"{self.memory_bytes / GIB:.0f} GiB each, peak {self.peak_tflops:g} TFLOP/s "
            f"(matmuls at {self.matmul_efficiency:.0%} of it), intra-node "
            f"{self.intra_node_gbps:g} GB/s, inter-node {self.inter_node_gbps:g} GB/s per GPU, "
            f"{self.collective_latency_us:g} us per collective"
        )


def _dgx(
    name: str, device: str, nvlink_bidirectional: float, ib_gbit: float, hbm_gbps: float
) -> Cluster:
    return Cluster(
        name=name,
        gpus_per_node=8,
        nodes=1,
        memory_bytes=80 * GIB,
        peak_tflops=device_peak_tflops(device, torch.bfloat16),
        intra_node_gbps=nvlink_bidirectional / 2,
        inter_node_gbps=ib_gbit / 8,
        memory_gbps=hbm_gbps,
    )


PRESETS: dict[str, Cluster] = {
    # 8x A100-80GB SXM, 312 TFLOP/s bf16, NVLink 600 GB/s, 8x 200 Gb/s HDR InfiniBand, HBM2e
    # 2,039 GB/s (data sheets)
    "dgx-a100": _dgx("DGX A100", "NVIDIA A100-SXM4-80GB", 600.0, 200.0, 2039.0),
    # 8x H100-80GB SXM, 989.4 TFLOP/s bf16, NVLink 900 GB/s, 8x 400 Gb/s NDR InfiniBand, HBM3
    # 3,350 GB/s (data sheets)
    "dgx-h100": _dgx("DGX H100", "NVIDIA H100 80GB HBM3", 900.0, 400.0, 3350.0),
}
