"""ZeRO-2 and ZeRO-3 on torch's FSDP2: shard a rank's model chunks over its data-parallel group.

The data-parallel group here is the one that holds a model replica's parameters: DP x CP with
context parallelism (`ParallelState.dp_cp`), over which FSDP2 averages the gradients too.

Built on `torch.distributed.fsdp.fully_shard` rather than a sharding engine of our own: it is
maintained with torch, torchtitan runs on it, and on gloo it trains megapipe's GPTModel with
no change to the layers (docs/ARCHITECTURE.md, "Facts for sharded data parallelism").

* Each `TransformerLayer` is one FSDP group, and the chunk (embedding, final norm, output layer,
  so a tied weight stays in one group) is the root. Each parameter is the TP-local tensor
  sharded by rows over DP (FSDP2's `Shard(0)`), as Megatron-LM's --use-torch-fsdp2 does.
* optim_grads_params (ZeRO-3) reshards after forward: a layer's weights are gathered for its
  forward and again for its backward. The chunk root is not (FSDP2's default for a root): its
  weights are needed again as soon as the backward starts, and it is gathered through the
  whole forward and backward anyway, so resharding it in between would only re-gather the
  embedding once more per micro-batch (no lower peak). optim_grads (ZeRO-2) keeps everything
  gathered from forward to backward, so only the gradients and the optimizer state stay
  sharded through the step.
* Hybrid sharding (--num-distributed-optimizer-instances N) is FSDP2's HSDP over a 2-D mesh
  (replicate across the N groups, shard inside each); the gradients are all-reduced across.
* bf16/fp16: the sharded parameters stay fp32 (they are the optimizer's master weights), the
  gathered copies are in the training dtype and gradients are reduce-scattered in fp32
  (`MixedPrecisionPolicy`); bytes per parameter at rest are 16/d.
* --overlap-param-gather prefetches: each layer's forward issues the next layer's all-gather
  and each layer's backward the previous one's (FSDP2's explicit prefetch lists).
* Expert parallelism (MoE): each layer's experts are an FSDP group of their own, sharded over
  the expert-data-parallel group (the ranks that hold the same experts), and their gradients
  divided by DP x CP like every other's (they already sum every EP rank's tokens').
* FSDP2 drops custom parameter attributes: `ParamMeta` (`param.meta`) is put back on the
  sharded parameters, which the grad norm, the SP/tied-embedding sums and the checkpoint read.

What FSDP2 does not give: megapipe's fp32 `main_grad` accumulation (gradients accumulate in
the sharded fp32 gradient after each micro-batch's reduce-scatter instead, exact too), and
weight gradients computed after backward (zero-bubble schedules' W), which its per-backward
reduce-scatter would miss: `reduce_after_step` then keeps every layer gathered and reduces
once, after the step's last W (torch.distributed.pipelining's pattern).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

from megapipe.config import OptimizerConfig
from megapipe.layers.param_meta import is_expert
from megapipe.parallel.state import ParallelState


def shard_group_size(state: ParallelState) -> int:
    """Ranks one parameter is sharded over: the DP (x CP) group, or its hybrid inner group."""
    return state.dp_inner.size if state.dp_inner is not None else state.dp_cp.size


def uses_fsdp(config: OptimizerConfig, state: ParallelState) -> bool:
    """Whether this run shards gradients with FSDP2 (a shard group of one rank needs none)."""
    return config.fsdp and shard_group_size(state) > 1


ZERO_LEVEL = {"no_shard": 0, "optim": 1, "optim_grads": 2, "optim_grads_params": 3}


def describe_sharding(config: OptimizerConfig, state: ParallelState) -> str | None:
    """The start-up line naming the data-parallel sharding, or None without any."""
    strategy = config.sharding
    if strategy == "no_shard" or state.dp_cp.size == 1:
        return None
    engine = "torch FSDP2" if uses_fsdp(config, state) else "megapipe's distributed optimizer"
    kind = "data-parallel x context-parallel" if state.cp.size > 1 else "data-parallel"
    line = (
        f"> sharded data parallelism: ZeRO-{ZERO_LEVEL[strategy]} ({strategy}) with {engine} "
        f"over {state.dp_cp.size} {kind} ranks"
    )
    if state.dp_inner is not None and state.dp_outer is not None:
        line += (
            f" (hybrid: {state.dp_outer.size} groups of {state.dp_inner.size}, sharded inside "
            "each and replicated across)"
        )
    if shard_group_size(state) == 1:
        line += "; shard groups of one rank: plain data parallelism"
    return line


def data_parallel_mesh(state: ParallelState) -> DeviceMesh:
    """The DP (x CP) group as a DeviceMesh: 1-D, or (replicate, shard) for hybrid sharding."""
    device = state.device.type
    if state.dp_inner is None or state.dp_outer is None or state.dp_outer.size == 1:
        return DeviceMesh.from_group(state.dp_cp.pg, device, mesh_dim_names=("shard",))
    inner, outer = state.dp_inner, state.dp_outer
    ranks = torch.tensor(state.dp_cp.ranks).view(outer.size, inner.size)
    return DeviceMesh.from_group(
        [outer.pg, inner.pg], device, mesh=ranks, mesh_dim_names=("replicate", "shard")
    )


def shard_chunks(
    chunks: Sequence[torch.nn.Module],
    layers: Sequence[Sequence[torch.nn.Module]],
    state: ParallelState,
    config: OptimizerConfig,
) -> list[FSDPModule]:
    """Wrap every chunk in FSDP2 as the module docstring says (collective over DP), each of
    `layers[i]` (chunk i's transformer layers, in order) a group of its own; returns every FSDP
    module, layers first, roots last. The chunks stay the same Python objects."""
    mesh = data_parallel_mesh(state)
    dtype = config.params_dtype
    policy = MixedPrecisionPolicy(
        param_dtype=None if dtype == torch.float32 else dtype, reduce_dtype=torch.float32
    )
    reshard = config.sharding == "optim_grads_params"
    expert_mesh = None
    if state.ep.size > 1:
        expert_mesh = DeviceMesh.from_group(
            state.expert_dp.pg, state.device.type, mesh_dim_names=("shard",)
        )
    wrapped: list[FSDPModule] = []
    roots: list[FSDPModule] = []
    for chunk, chunk_layers in zip(chunks, layers):
        metas = {name: p.meta for name, p in chunk.named_parameters()}
        for layer in chunk_layers:
            for experts in _expert_modules(layer) if expert_mesh is not None else []:
                fully_shard(
                    experts, mesh=expert_mesh, reshard_after_forward=reshard, mp_policy=policy
                )
                # divided after a SUM: gloo has no PREMUL_SUM, the op such a factor maps to
                experts.set_gradient_divide_factor(float(state.dp_cp.size))
                experts.set_force_sum_reduction_for_comms(True)
                wrapped.append(experts)
            fully_shard(layer, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
        roots.append(fully_shard(chunk, mesh=mesh, reshard_after_forward=False, mp_policy=policy))
        for name, param in chunk.named_parameters():
            param.meta = metas[name]
        if config.overlap_param_gather:
            for before, after in zip(chunk_layers, chunk_layers[1:]):
                before.set_modules_to_forward_prefetch([after])
                after.set_modules_to_backward_prefetch([before])
        wrapped += chunk_layers
    return wrapped + roots


def _expert_modules(layer: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules of `layer` that hold MoE expert parameters themselves."""
    return [
        module
        for module in layer.modules()
        if any(is_expert(p) for p in module.parameters(recurse=False))
    ]


@contextlib.contextmanager
def reduce_after_step(modules: Sequence[FSDPModule]) -> Iterator[None]:
    """Around a step whose weight gradients come after backward (zero-bubble W): FSDP2 neither
    reduces nor reshards at the end of each backward, so every gradient, deferred or not,
    accumulates in the gathered parameters' `.grad` (in the training dtype) and is
    reduce-scattered once, when the step's last W is done; then the parameters are resharded.
    The price: the whole stage stays gathered through the step (ZeRO-2's peak, under ZeRO-3
    too), and bf16 gradients are summed over micro-batches in bf16 before the fp32 reduce.

    Uses FSDP2's per-group `post_backward` and the root's final callback, the calls
    torch.distributed.pipelining makes for the same purpose (private in torch 2.13)."""
    for module in modules:
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False, recurse=False)
        module.set_requires_gradient_sync(False, recurse=False)
    yield
    roots = []
    for module in modules:
        module.set_is_last_backward(True)
        module.set_reshard_after_backward(True, recurse=False)
        module.set_requires_gradient_sync(True, recurse=False)
        state = fully_shard.state(module)
        if state._is_root:
            roots.append(state)
    for root in roots:
        for state in root._state_ctx.all_states:
            for group in state._fsdp_param_groups:
                group.post_backward()
        root._root_post_backward_final_callback()


def reshard(modules: Sequence[FSDPModule]) -> None:
    """Free every gathered parameter (after a forward-only pass under ZeRO-2, which leaves
    them gathered for a backward that never comes)."""
    for module in modules:
        module.reshard()


def local_part(param: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(this rank's values as a flat tensor, the flat offset where they start in the TP-local
    parameter): the whole tensor at 0, or an FSDP2 shard, whole rows of it."""
    if not isinstance(param, DTensor):
        return param.data.view(-1), 0
    return param.to_local().detach().view(-1), _first_row(param) * _row_size(param)


def _row_size(param: DTensor) -> int:
    size = 1
    for dim in param.shape[1:]:
        size *= dim
    return size


def _first_row(param: DTensor) -> int:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offsets = compute_local_shape_and_global_offset(
        param.shape, param.device_mesh, param.placements
    )
    return offsets[0] if offsets else 0
