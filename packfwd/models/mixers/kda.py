"""The Megatron-Core module of Kimi Delta Attention (Kimi-Linear's linear attention): :class:`PackedKimiDeltaAttention`,
Gated DeltaNet's module (:class:`~packfwd.models.mixers.gdn.PackedGatedDeltaNet`: THD, BSHD, tensor, sequence and
context parallelism, the calling convention) with KDA's projections and math
(:func:`~packfwd.models.mixers.deltanet.kda_mix`).  Its component and weight table are
:mod:`packfwd.models.mixers.kimi_delta`.

Its projections give, for this TP rank's heads, the math's per-head inputs ``[q | k | v | f | b | gate]``: ``in_proj``
(column-parallel, ``[q | k | v | b]``), and the two low-rank gates ``f_b_proj(f_a_proj(x))`` and
``g_b_proj(g_a_proj(x))``, whose down projections are column-parallel with their outputs gathered over TP (and,
under sequence parallelism, cut back to each rank's tokens before the up projections, which gather them again), as
multi-head latent attention's are.  Every input being per head, context parallelism trades tokens for heads as
for Gated DeltaNet: each CP rank runs whole sequences of ``1 / cp`` of the heads.

This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from ..norm import RMSNorm
from .deltanet import kda_mix
from .gdn import PackedGatedDeltaNet

__all__ = ["PackedKimiDeltaAttention", "kda_spec"]


class PackedKimiDeltaAttention(PackedGatedDeltaNet):
    """A Kimi Delta Attention layer (module docstring), built by ``TransformerLayer`` with Megatron's keywords and
    the spec's param ``kda`` (a :class:`~packfwd.models.mixers.kimi_delta.Kda`).  Parameters: ``in_proj``
    (``[q | k | v | b]`` of this rank's heads), ``conv1d`` (depthwise over ``[q | k | v]``, no bias), ``f_a_proj``,
    ``f_b_proj``, ``dt_bias`` (per channel), ``A_log`` (per head), ``g_a_proj``, ``g_b_proj``, ``out_norm`` (the
    sigmoid-gated RMSNorm's weight over ``head_dim``), ``out_proj``.  Inference arguments raise."""

    def __init__(self, config, layer_number: int, pg_collection=None, name: str | None = None, *, kda, **unused):
        MegatronModule.__init__(self, config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection, self.layer_number, self.name, self.deltanet = pg_collection, layer_number, name, kda
        tp = pg_collection.tp.size() if pg_collection.tp is not None else 1
        for what, width in (("linear_num_heads", kda.num_heads), ("linear_head_dim", kda.head_dim)):
            if width % tp:
                raise ValueError(f"{what}={width} is not divisible by the TP size {tp}; pick one that is")
        self.tp = tp
        cp = getattr(pg_collection, "cp", None)
        self._check_cp(max(cp.size() if cp is not None else 1, getattr(config, "context_parallel_size", 1)))
        self.sections = kda.sections(tp)
        self.shape = kda.shape(config.hidden_size, config.layernorm_epsilon, tp)
        heads_dim = kda.num_heads * kda.head_dim

        def column(size_in, size_out, name):
            return ColumnParallelLinear(size_in, size_out, config=config, init_method=config.init_method,
                                        gather_output=False, bias=False, skip_bias_add=False, is_expert=False,
                                        tp_comm_buffer_name=name, tp_group=pg_collection.tp)

        self.in_proj = column(config.hidden_size, sum(kda.in_proj_sections()), "fc1")
        self.f_a_proj = column(config.hidden_size, kda.head_dim, "f_a_proj")
        self.f_b_proj = column(kda.head_dim, heads_dim, "f_b_proj")
        self.g_a_proj = column(config.hidden_size, kda.head_dim, "g_a_proj")
        self.g_b_proj = column(kda.head_dim, heads_dim, "g_b_proj")
        conv = 3 * heads_dim // tp
        self.conv1d = torch.nn.Conv1d(conv, conv, kda.conv_kernel_dim, groups=conv, bias=False,
                                      padding=kda.conv_kernel_dim - 1, dtype=config.params_dtype)
        # at least float32, as transformers keeps it (_keep_in_fp32_modules_strict): a bf16 copy would move the gate
        self.dt_bias = torch.nn.Parameter(torch.ones(heads_dim // tp,
                                                     dtype=torch.promote_types(config.params_dtype, torch.float32)))
        self.A_log = torch.nn.Parameter(torch.zeros(kda.num_heads // tp, dtype=config.params_dtype))
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self.out_norm = RMSNorm(config, hidden_size=kda.head_dim, eps=config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            heads_dim, config.hidden_size, config=config, init_method=config.output_layer_init_method, bias=False,
            input_is_parallel=True, skip_bias_add=True, is_expert=False, tp_comm_buffer_name="fc2",
            tp_group=pg_collection.tp)
        if config.perform_initialization:
            self._init_decay()

    LAYERS = "Kimi Delta Attention layers"
    HEADS = "linear_num_heads"

    def _split_heads(self) -> int:
        return self.deltanet.num_heads

    def _low_rank(self, down, up, x: Tensor) -> Tensor:
        """``up(down(x))`` of this rank's heads: the down projection's output gathered over TP (its rows are cut
        in ``tp``), cut back to this rank's tokens under sequence parallelism before ``up`` gathers them."""
        latent, _ = down(x)
        if self.tp > 1:
            from megatron.core.tensor_parallel.mappings import (gather_from_tensor_model_parallel_region,
                                                                scatter_to_sequence_parallel_region)

            latent = gather_from_tensor_model_parallel_region(latent, group=self.pg_collection.tp)
            if self.config.sequence_parallel:
                latent = scatter_to_sequence_parallel_region(latent, group=self.pg_collection.tp)
        return up(latent)[0]

    def _in_proj(self, hidden_states: Tensor) -> Tensor:
        q, k, v, b = self.in_proj(hidden_states)[0].split(list(self.deltanet.in_proj_sections(self.tp)), dim=-1)
        f = self._low_rank(self.f_a_proj, self.f_b_proj, hidden_states)
        gate = self._low_rank(self.g_a_proj, self.g_b_proj, hidden_states)
        return torch.cat((q, k, v, f, b, gate), dim=-1)

    def _mix(self, x, sections, shape, weights, cu, cu_pad, longest):
        """``x: [t, sum(sections)]`` (``[q | k | v | f | b | gate]``) -> ``[t, H d]`` of ``shape``'s heads."""
        qkv, f, b, gate = x.split([sum(sections[:3]), *sections[3:]], dim=-1)
        return kda_mix(qkv, f, b, gate, weights, shape, cu, cu_seqlens_padded=cu_pad, max_seqlen=longest,
                       chunk_size=self.deltanet.chunk_size)


def kda_spec(args):
    """The ``ModuleSpec`` of a Kimi Delta Attention layer's token mixer for ``args`` (``args.linear_attention`` a
    :class:`~packfwd.models.mixers.kimi_delta.Kda`).

    >>> from packfwd.models.mixers import Kda
    >>> from types import SimpleNamespace
    >>> spec = kda_spec(SimpleNamespace(linear_attention=Kda(2, 4, layers=(0,))))
    >>> spec.module.__name__, spec.params["kda"].num_heads
    ('PackedKimiDeltaAttention', 2)
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=PackedKimiDeltaAttention, params={"kda": args.linear_attention})
