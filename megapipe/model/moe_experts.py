"""The experts of one MoE layer: every expert's fc1 and fc2 stacked by global expert id
(weight1 [E, fc1, h], weight2 [E, h, ffn], as nn.Linear's [out, in] per expert), split over TP
like the dense MLP (fc1's rows, with SwiGLU's [gate; up] as two blocks; fc2's columns), and
over expert parallelism by expert: EP rank r holds experts [r E / EP, (r + 1) E / EP).

Input rows arrive grouped by expert (`counts[e]` rows for expert e, in expert order); each
group goes through its expert's MLP, by one GEMM per expert or by torch's grouped matmul
(--moe-grouped-gemm), which gives the same numbers. Under TP the input is copied into the
TP region and each row's output all-reduced before fc2's bias, so everything after (the
probability weighting, the router's gradient) sees whole outputs on every rank.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megapipe.config import ModelConfig
from megapipe.layers.param_meta import ParamMeta, make_param
from megapipe.parallel.mappings import copy_to_tp_region, reduce_from_tp_region
from megapipe.parallel.state import Group


def grouped_mm_available() -> bool:
    """Whether this torch has a grouped matmul (torch.nn.functional.grouped_mm)."""
    return hasattr(F, "grouped_mm")


class Experts(torch.nn.Module):
    """E expert MLPs of ffn size `ffn_hidden_size` (GeLU, squared ReLU or SwiGLU)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: Group,
        num_experts: int,
        ffn_hidden_size: int,
        *,
        output_init_std: float,
        grouped_gemm: bool = False,
        ep: Group | None = None,
    ) -> None:
        """num_experts: the layer's (global) count; this rank holds num_experts / EP."""
        super().__init__()
        self.tp = tp
        ep_size = ep.size if ep is not None else 1  # make_param checks that E splits over it
        self.num_experts = num_experts // ep_size  # local experts
        self.swiglu, self.squared_relu = config.swiglu, config.squared_relu
        self.gelu_approximate = "tanh" if config.openai_gelu else "none"
        self.grouped_gemm = grouped_gemm and grouped_mm_available()
        h, e = config.hidden_size, num_experts
        stride = 2 if config.swiglu else 1
        fc1 = ffn_hidden_size * stride
        std = config.init_method_std
        expert = {"expert_parallel": True}
        self.weight1 = make_param(
            ParamMeta((e, fc1, h), tp_dim=1, tp_stride=stride, init_std=std, **expert),
            tp.size,
            ep_size,
        )
        self.weight2 = make_param(
            ParamMeta((e, h, ffn_hidden_size), tp_dim=2, init_std=output_init_std, **expert),
            tp.size,
            ep_size,
        )
        self.bias1 = self.bias2 = None
        if config.add_bias_linear:
            self.bias1 = make_param(
                ParamMeta((e, fc1), tp_dim=1, tp_stride=stride, **expert), tp.size, ep_size
            )
            self.bias2 = make_param(ParamMeta((e, h), **expert), tp.size, ep_size)

    def forward(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """x [n, h] grouped by local expert (counts[e] rows each) -> [n, h], same order."""
        if self.tp.size > 1:
            x = copy_to_tp_region(x, self.tp)
        expert_of_row = None
        if self.bias1 is not None:
            expert_of_row = torch.repeat_interleave(
                torch.arange(self.num_experts, device=x.device),
                torch.tensor(counts, device=x.device),
            )
        if self.grouped_gemm and self._grouped_mm_fits(x):
            offsets = torch.tensor(counts, device=x.device).cumsum(0).to(torch.int32)
            h = F.grouped_mm(x, self.weight1.transpose(1, 2).contiguous(), offs=offsets)
            if self.bias1 is not None:
                h = h + self.bias1[expert_of_row]
            y = F.grouped_mm(
                self._activation(h), self.weight2.transpose(1, 2).contiguous(), offs=offsets
            )
        else:
            outputs, start = [], 0
            for e, n in enumerate(counts):
                rows = x[start : start + n]
                bias = self.bias1[e] if self.bias1 is not None else None
                hidden = self._activation(F.linear(rows, self.weight1[e], bias))
                outputs.append(F.linear(hidden, self.weight2[e]))
                start += n
            y = torch.cat(outputs) if outputs else x.new_zeros((0, self.weight2.shape[1]))
        if self.tp.size > 1:
            y = reduce_from_tp_region(y, self.tp)
        if self.bias2 is not None:
            y = y + self.bias2[expert_of_row]
        return y

    def _grouped_mm_fits(self, x: torch.Tensor) -> bool:
        """torch's grouped matmul wants every operand's strides in 16-byte multiples (on the
        CPU at least); otherwise the loop runs (same numbers)."""
        multiple = max(1, 16 // x.element_size())
        dims = (x.shape[1], self.weight1.shape[1], self.weight2.shape[2])
        return all(d % multiple == 0 for d in dims)

    def _activation(self, h: torch.Tensor) -> torch.Tensor:
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            return F.silu(gate) * up
        if self.squared_relu:
            return torch.square(F.relu(h))
        return F.gelu(h, approximate=self.gelu_approximate)
