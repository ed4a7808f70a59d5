"""packfwd's MoE router: Megatron-Core's ``TopKRouter`` that routes no layout pad and can record its routing.

See :mod:`packfwd.models.mlp.moe` for what it changes and why.  This module imports Megatron-Core;
:func:`packfwd.models.mlp.moe.moe_spec` imports it only when a model is built.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.moe.router import TopKRouter
from torch import Tensor

from .routing import RoutingStats

__all__ = ["PackedRouter", "gate_dtype"]


class PackedRouter(TopKRouter):
    """Megatron-Core's ``TopKRouter`` whose padding slots are routed to no expert (:mod:`packfwd.models.mlp.moe`).

    >>> from packfwd.models.runtime import ensure_model_parallel
    >>> from megatron.core.transformer.transformer_config import TransformerConfig
    >>> from megatron.core.process_groups_config import ProcessGroupCollection
    >>> ensure_model_parallel()
    >>> config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
    ...                            moe_router_topk=2, moe_ffn_hidden_size=8, moe_router_load_balancing_type="none",
    ...                            use_cpu_initialization=True)
    >>> router = PackedRouter(config, ProcessGroupCollection.use_mpu_process_groups())
    >>> pads = torch.tensor([[False, True, False]])             # [b, s]: the middle slot is padding
    >>> probs, routing_map = router(torch.randn(3, 1, 8), pads.T)  # MoELayer hands it [s, b]
    >>> routing_map.sum(-1).tolist(), (probs[1] == 0).all().item()
    ([2, 0, 2], True)
    """

    record: list | None = None  # set by packfwd.models.mlp.moe.routing_stats while it is open

    def __init__(self, config, *args, **kwargs):
        """Megatron-Core's constructor; with ``config.moe_router_enable_expert_bias`` the ``expert_bias`` buffer
        (at least float32: float64 in a float64 model; in the state dict) and its ``local_tokens_per_expert`` counts are made beside the weight:
        Megatron-Core makes them on ``torch.cuda.current_device()``, which fails without CUDA."""
        bias = config.moe_router_enable_expert_bias
        super().__init__(_without_expert_bias(config) if bias else config, *args, **kwargs)
        if bias:
            self.config, self.enable_expert_bias = config, True
            del self.expert_bias, self.local_tokens_per_expert  # Megatron's None attributes
            for name, dtype in (("local_tokens_per_expert", torch.float32), ("expert_bias", _bias_dtype(config))):
                zeros = torch.zeros(self.num_experts, dtype=dtype, device=self.weight.device)
                self.register_buffer(name, zeros, persistent=name == "expert_bias")

    def _maintain_float32_expert_bias(self) -> None:
        """Megatron-Core casts the bias back to float32 before each forward, save and load (a half-precision
        wrapper may have cast it down); here to at least float32: a float64 model's bias stays float64."""
        bias = getattr(self, "expert_bias", None)
        if bias is not None and bias.dtype != _bias_dtype(self.config):
            bias.data = bias.data.to(_bias_dtype(self.config))

    def reset_parameters(self) -> None:
        """Megatron-Core's initialisation (float32, then cast to ``params_dtype``), but with
        ``config.moe_router_dtype`` the weight (and bias) kept in :func:`gate_dtype`: transformers keeps GLM-4.5's
        and DeepSeek-V3's gate float32 in a bf16 model, and a bf16 copy of it routes some tokens elsewhere."""
        weight, bias = self.weight.data, None if self.bias is None else self.bias.data  # float32, initialised in place
        super().reset_parameters()
        dtype = gate_dtype(self.config)
        if dtype is not None:
            self.weight.data = weight.to(dtype)
            if bias is not None:
                self.bias.data = bias.to(dtype)

    def gating(self, input: Tensor) -> Tensor:
        """The router logits ``[s, b, E]``: a plain linear on the input's device, in ``config.moe_router_dtype``
        (``"fp32"``, ``"fp64"``: the input cast for the router only, as transformers does) or else the input's
        dtype."""
        dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(self.config.moe_router_dtype, input.dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(input.to(dtype), self.weight.to(dtype), bias)

    def forward(self, input: Tensor, padding_mask: Tensor | None = None):
        """Megatron-Core's routing of ``input [s, b, h]``; ``padding_mask [s, b]`` True at padding slots (this
        rank's tokens; a full-length mask on a later pipeline stage under sequence parallelism, which
        Megatron-Core does not scatter there, is cut to this rank's share)."""
        if padding_mask is not None:
            padding_mask = self._local(padding_mask, input.shape[:2])
        return super().forward(input, padding_mask)

    def routing(self, logits: Tensor, padding_mask: Tensor | None = None):
        """Megatron-Core's top-k routing, then the padding rows emptied; records :class:`RoutingStats`."""
        probs, routing_map = super().routing(logits, padding_mask=padding_mask)
        real = None if padding_mask is None else ~padding_mask.reshape(-1, 1)
        if real is not None:
            routing_map = routing_map.bool() & real
            probs = probs * real
        if self.record is not None:
            self.record.append(self._stats(logits.reshape(-1, self.num_experts), routing_map, real))
        return probs, routing_map

    def _apply_expert_bias(self, routing_map: Tensor, padding_mask: Tensor | None = None) -> None:
        """Megatron-Core's count of each expert's tokens for its expert-bias update, eager: Megatron-Core compiles
        this helper, and under torch 2.11 megatron-core 0.19.2's compiled one fails inside Dynamo even when the
        expert bias is off.  Nothing to count without an expert bias."""
        if not (self.enable_expert_bias and torch.is_grad_enabled()):
            return
        with torch.no_grad():
            if padding_mask is not None:
                routing_map = routing_map & ~padding_mask.reshape(-1, 1)
            self.local_tokens_per_expert += routing_map.sum(0)

    def _stats(self, logits: Tensor, routing_map: Tensor, real: Tensor | None) -> RoutingStats:
        dtype = torch.promote_types(logits.dtype, torch.float32)
        if self.score_function == "sigmoid":  # Megatron's scores for its auxiliary loss
            scores = torch.sigmoid(logits.to(dtype))
            scores = scores / (scores.sum(-1, keepdim=True) + 1e-20)
        else:
            scores = torch.softmax(logits.to(dtype), dim=-1)
        if real is None:
            tokens = torch.tensor(float(logits.shape[0]), dtype=dtype, device=logits.device)
        else:
            scores, tokens = scores * real, real.sum().to(dtype)
        return RoutingStats(routing_map.sum(0).to(dtype), scores.sum(0), tokens)

    def _local(self, mask: Tensor, shape) -> Tensor:
        s, b = shape
        if mask.dim() != 2 or mask.shape[1] != b or mask.dtype != torch.bool:
            raise ValueError(f"padding_mask has shape {tuple(mask.shape)} and dtype {mask.dtype} at an MoE layer "
                             f"of {s} x {b} tokens; pass a bool [b, s] mask like input_ids, True at padding")
        tp = self.tp_group.size() if self.config.sequence_parallel else 1
        if mask.shape[0] == s * tp and tp > 1:
            rank = self.tp_group.rank()
            return mask[rank * s:(rank + 1) * s]
        if mask.shape[0] != s:
            raise ValueError(f"padding_mask covers {mask.shape[0]} tokens per row but this MoE layer routes {s}; "
                             "pass a [b, s] mask like input_ids, True at padding")
        return mask


def gate_dtype(config) -> torch.dtype | None:
    """The dtype of the router's weight: at least float32 when the router computes in its own dtype
    (``config.moe_router_dtype``), else None (Megatron-Core's ``params_dtype``).

    >>> from types import SimpleNamespace
    >>> gate_dtype(SimpleNamespace(moe_router_dtype="fp32", params_dtype=torch.bfloat16))
    torch.float32
    >>> gate_dtype(SimpleNamespace(moe_router_dtype="fp32", params_dtype=torch.float64))
    torch.float64
    >>> gate_dtype(SimpleNamespace(moe_router_dtype=None, params_dtype=torch.bfloat16)) is None
    True
    """
    if config.moe_router_dtype is None:
        return None
    return torch.promote_types(config.params_dtype, torch.float32)


def _bias_dtype(config) -> torch.dtype:
    """The expert bias's dtype: at least float32 (a float64 model keeps a float64 checkpoint's values)."""
    return torch.promote_types(torch.float32, getattr(config, "params_dtype", torch.float32))


def _without_expert_bias(config):
    config = copy.copy(config)  # shallow: Megatron-Core's own TransformerConfig, one flag changed
    config.moe_router_enable_expert_bias = False
    return config
