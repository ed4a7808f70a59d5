"""The Megatron-Core modules of the hybrid families' token mixers: :class:`PackedGatedDeltaNet` (a Gated DeltaNet
layer over packed or BSHD batches, Megatron-Core's ``GatedDeltaNet`` parameters and TP layout) and
:class:`GatedSelfAttention` (Megatron-Core's ``SelfAttention`` with ``attention_output_gate``, the gate applied in
the output's dtype promoted to float32 at least).  Their components are :mod:`packfwd.models.mixers.gated_deltanet`
and :mod:`packfwd.models.mixers.gated_attention`.

A Gated DeltaNet layer stands where ``TransformerLayer`` puts its self-attention and is called the same way:
``(hidden_states [s, b, h], attention_mask=None, *, packed_seq_params=None, ...) -> (output, bias)``, rotary
arguments ignored.  Its linears are Megatron's tensor-parallel ones (``in_proj`` column-parallel, ``out_proj``
row-parallel), so under sequence parallelism ``in_proj`` gathers the tokens and ``out_proj`` scatters them back, as
for softmax attention; each TP rank runs its own heads over every token.  Between them
(:func:`packfwd.models.mixers.deltanet.deltanet_mix`):

* THD (``packed_seq_params.qkv_format == "thd"``, ``[t, 1, h]``): sequences start at ``cu_seqlens_q_padded`` (else
  ``cu_seqlens_q``) with ``cu_seqlens_q`` real tokens each; the convolution and the state restart at every
  sequence, pad rows (alignment, sequence-parallel padding) are never read and come out zero.
* BSHD (no params): each row is one sequence from its first position (real tokens first, as
  :func:`packfwd.to_bshd` and ``make_forward("bshd")`` lay them out; a row's trailing pads cannot reach its real
  tokens through a causal convolution and a causal state).  A padding mask is refused: a BSHD batch with padding
  reaches the layers packed (``PackedGPTModel.forward`` with ``attention_mask``).

* THD under context parallelism (the CP place of :func:`~packfwd.models.mixers.attention.thd_cp_place`, as for
  softmax attention): each CP rank holds its zigzag share of every sequence, but the convolution and the state need
  each sequence whole, so the layer trades tokens for heads instead of handing a state from rank to rank: after
  ``in_proj`` an all-to-all over the CP group (:func:`packfwd.parallel.heads.zigzag_to_heads`) gives each CP rank
  every token, in each sequence's natural order (``cu_seqlens_q_padded`` of the whole sequences), of ``1 / cp`` of
  this TP rank's key heads and the value heads they serve (``[q | k | v | z | b | a]`` each cut in ``cp``; its rows
  of ``conv1d``, ``A_log``, ``dt_bias`` with them, ``out_norm`` whole); the packed math runs on them, and the
  inverse all-to-all (:func:`~packfwd.parallel.heads.heads_to_zigzag`) returns the zigzag rows of every head to
  ``out_proj``.  Exact: each head sees its sequences whole.  The key heads must divide by ``tp * cp`` (refused when
  built, and when a batch's CP place says another ``cp``, naming context parallelism); a parameter's gradient on
  a CP rank is its heads' part over all tokens, summed over the CP ranks as Megatron's data-parallel reduction
  does.  BSHD under context parallelism is refused (THD only, as for softmax attention).

This module imports Megatron-Core; ``packfwd.models`` imports it only when a model is built.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.module import MegatronModule
from torch import Tensor

from ..norm import RMSNorm
from .attention import thd_cp_place
from .deltanet import deltanet_mix

__all__ = ["GatedSelfAttention", "PackedGatedDeltaNet", "gated_deltanet_spec"]


class GatedSelfAttention(SelfAttention):
    """Megatron-Core's ``SelfAttention`` (built with ``attention_output_gate=True``) whose output gate
    ``x * sigmoid(gate)`` is computed in ``x``'s dtype promoted to float32 at least: Megatron-Core's float32
    arithmetic for bf16 / fp16 / fp32, and float64 kept float64."""

    def _apply_output_gate(self, x: Tensor, gate: Tensor) -> Tensor:
        cdt = torch.promote_types(x.dtype, torch.float32)
        return (x.to(cdt) * torch.sigmoid(gate.contiguous().view(*x.shape).to(cdt))).to(x.dtype)


class PackedGatedDeltaNet(MegatronModule):
    """A Gated DeltaNet layer (module docstring), built by ``TransformerLayer`` with Megatron's keywords and the
    spec's param ``deltanet`` (a :class:`~packfwd.models.mixers.gated_deltanet.DeltaNet`).  Parameters, as
    Megatron-Core's ``GatedDeltaNet`` names them: ``in_proj`` (``[q | k | v | z | b | a]`` of this rank's heads),
    ``conv1d`` (depthwise over ``[q | k | v]``, no bias), ``A_log``, ``dt_bias``, ``out_norm`` (the gated RMSNorm's
    weight over ``head_v_dim``), ``out_proj``.  Inference arguments raise."""

    def __init__(self, config, layer_number: int, pg_collection=None, name: str | None = None, *, deltanet,
                 **unused):
        super().__init__(config)
        from megatron.core.process_groups_config import ProcessGroupCollection
        from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear

        if pg_collection is None:
            pg_collection = ProcessGroupCollection.use_mpu_process_groups()
        self.pg_collection, self.layer_number, self.name, self.deltanet = pg_collection, layer_number, name, deltanet
        tp = pg_collection.tp.size() if pg_collection.tp is not None else 1
        for what, heads in (("linear_num_key_heads", deltanet.num_k_heads), ("linear_num_value_heads",
                                                                            deltanet.num_v_heads)):
            if heads % tp:
                raise ValueError(f"{what}={heads} is not divisible by the TP size {tp}; pick one that is")
        self.tp = tp
        cp = getattr(pg_collection, "cp", None)
        self._check_cp(max(cp.size() if cp is not None else 1, getattr(config, "context_parallel_size", 1)))
        self.sections = deltanet.in_proj_sections(tp)
        self.shape = deltanet.shape(config.hidden_size, config.layernorm_epsilon, tp)
        conv = sum(self.sections[:3])
        self.in_proj = ColumnParallelLinear(
            config.hidden_size, sum(deltanet.in_proj_sections()), config=config, init_method=config.init_method,
            gather_output=False, bias=False, skip_bias_add=False, is_expert=False, tp_comm_buffer_name="fc1",
            tp_group=pg_collection.tp)
        self.conv1d = torch.nn.Conv1d(conv, conv, deltanet.conv_kernel_dim, groups=conv, bias=False,
                                      padding=deltanet.conv_kernel_dim - 1, dtype=config.params_dtype)
        heads = self.shape.num_v_heads
        self.dt_bias = torch.nn.Parameter(torch.ones(heads, dtype=config.params_dtype))
        self.A_log = torch.nn.Parameter(torch.zeros(heads, dtype=config.params_dtype))
        for p in (self.conv1d.weight, self.dt_bias, self.A_log):  # as Megatron-Core tags them
            p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, 0, 1
        self.out_norm = RMSNorm(config, hidden_size=deltanet.head_v_dim, eps=config.layernorm_epsilon)
        self.out_proj = RowParallelLinear(
            deltanet.num_v_heads * deltanet.head_v_dim, config.hidden_size, config=config,
            init_method=config.output_layer_init_method, bias=False, input_is_parallel=True, skip_bias_add=True,
            is_expert=False, tp_comm_buffer_name="fc2", tp_group=pg_collection.tp)
        if config.perform_initialization:
            self._init_decay()

    def _init_decay(self) -> None:
        """Megatron-Core's initialisation of the decay: ``A`` uniform in [1, 16], ``dt`` log-uniform in
        [0.001, 0.1] (``dt_bias`` its inverse softplus)."""
        with torch.no_grad():
            self.A_log.copy_(torch.empty_like(self.A_log).uniform_(1, 16).log())
            dt = torch.exp(torch.rand_like(self.dt_bias) * (math.log(0.1) - math.log(0.001)) + math.log(0.001))
            dt = dt.clamp(min=1e-4)
            self.dt_bias.copy_(dt + torch.log(-torch.expm1(-dt)))

    LAYERS = "Gated DeltaNet layers"  # what _check_cp's message calls the layer
    HEADS = "linear_num_key_heads"  # the config field of the heads CP cuts (and _split_heads counts)

    def _split_heads(self) -> int:
        """The heads context parallelism cuts: the key heads (each with the value heads it serves)."""
        return self.deltanet.num_k_heads

    def _check_cp(self, cp_size: int) -> None:
        """Context parallelism cuts each TP rank's heads (:meth:`_split_heads`) in ``cp_size``."""
        heads = self._split_heads()
        if cp_size > 1 and heads % (self.tp * cp_size):
            raise ValueError(f"context parallelism (cp_size={cp_size}) with {self.LAYERS} splits each TP rank's "
                             f"heads over the CP ranks: {self.HEADS}={heads} must be divisible by tp_size * cp_size "
                             f"= {self.tp * cp_size}; pick a cp_size that divides {heads // self.tp}")

    def forward(self, hidden_states, attention_mask=None, inference_context=None, rotary_pos_emb=None,
                rotary_pos_cos=None, rotary_pos_sin=None, rotary_pos_cos_sin=None, attention_bias=None,
                packed_seq_params=None, sequence_len_offset=None, *, inference_params=None, **unused):
        given = sorted(n for n, v in dict(inference_context=inference_context, inference_params=inference_params,
                                          attention_bias=attention_bias,
                                          sequence_len_offset=sequence_len_offset).items() if v is not None)
        if given:
            raise ValueError(f"packfwd's Gated DeltaNet layer runs training and scoring forwards: {given} are not "
                             "supported; pass None")
        if attention_mask is not None:
            raise ValueError("packfwd's Gated DeltaNet layer takes attention_mask=None: it runs per packed sequence "
                             "(THD) or per row (BSHD, real tokens first); pack the batch with packfwd.to_thd or "
                             "packfwd.to_bshd instead")
        thd = packed_seq_params is not None and packed_seq_params.qkv_format == "thd"
        if packed_seq_params is not None and not thd:
            raise ValueError(f"qkv_format={packed_seq_params.qkv_format!r} is not supported; use 'thd' or no params")
        cp_size, cp_rank, group = thd_cp_place(packed_seq_params, getattr(self.pg_collection, "cp", None))
        if cp_size > 1 and not thd:
            raise ValueError("context parallelism needs the THD layout; use data_format='thd'")
        x = self._in_proj(hidden_states)  # [s, b, in_proj / tp]: every token (sequence parallelism gathers them)
        s, b = x.shape[:2]
        if thd:
            params = packed_seq_params
            if b != 1:
                raise ValueError(f"a THD batch is one packed row [t, 1, h], got hidden_states of shape "
                                 f"{tuple(hidden_states.shape)}")
            x, cu, cu_pad, longest = x[:, 0], params.cu_seqlens_q, params.cu_seqlens_q_padded, params.max_seqlen_q
        else:  # [s, b, *] -> [b * s, *]: each row one sequence
            x = x.transpose(0, 1).reshape(b * s, -1)
            cu, cu_pad, longest = torch.arange(b + 1, device=x.device, dtype=torch.int32) * s, None, s
        longest = longest if isinstance(longest, int) else None
        if cp_size > 1:
            out = self._mix_context_parallel(x, cu, cu_pad if cu_pad is not None else cu, longest, cp_size, cp_rank,
                                             group)
        else:
            out = self._mix(x, self.sections, self.shape, self._weights(), cu, cu_pad, longest)
        out = out[:, None] if thd else out.reshape(b, s, -1).transpose(0, 1)
        return self.out_proj(out)

    def _in_proj(self, hidden_states: Tensor) -> Tensor:
        """The per-head inputs of the math, ``[s, b, sum(self.sections)]`` of this rank's heads."""
        return self.in_proj(hidden_states)[0]

    def _weights(self, cp_size: int = 1, cp_rank: int = 0) -> dict:
        """The math's weights (:func:`~packfwd.models.mixers.deltanet.deltanet_mix`'s names) of CP rank
        ``cp_rank``'s heads: its piece of each ``conv1d`` section, of ``A_log`` and ``dt_bias``; ``out_norm``
        (over one head's channels) whole."""
        conv = self.conv1d.weight
        if cp_size > 1:
            conv = torch.cat([w.chunk(cp_size)[cp_rank] for w in conv.split(list(self.sections[:3]))])
        return {"conv1d.weight": conv, "A_log": self.A_log.chunk(cp_size)[cp_rank],
                "dt_bias": self.dt_bias.chunk(cp_size)[cp_rank], "norm.weight": self.out_norm.weight}

    def _mix(self, x, sections, shape, weights, cu, cu_pad, longest):
        """``x: [t, sum(sections)]`` (``[q | k | v | z | b | a]``) -> ``[t, value_dim]`` of ``shape``'s heads."""
        qkv, z, beta, alpha = x.split([sum(sections[:3]), *sections[3:]], dim=-1)
        return deltanet_mix(qkv, z, beta, alpha, weights, shape, cu, cu_seqlens_padded=cu_pad, max_seqlen=longest,
                            chunk_size=self.deltanet.chunk_size)

    def _mix_context_parallel(self, x, cu, cu_pad, longest, cp_size, cp_rank, group):
        """This CP rank's zigzag rows ``x: [t_local, in_proj / tp]`` -> ``[t_local, value_dim / tp]``, each head
        computed over whole sequences on one CP rank (module docstring)."""
        from packfwd.parallel.heads import heads_to_zigzag, zigzag_to_heads

        self._check_cp(cp_size)
        place = dict(cp_size=cp_size, cp_rank=cp_rank, cp_group=group)
        x = zigzag_to_heads(x, self.sections, cu_pad, **place)  # [t, in_proj / tp / cp]: whole sequences
        shape = self.deltanet.shape(self.shape.hidden_size, self.shape.eps, self.tp * cp_size)
        out = self._mix(x, [w // cp_size for w in self.sections], shape, self._weights(cp_size, cp_rank), cu,
                        cu_pad, longest)
        return heads_to_zigzag(out, [self.shape.value_dim], cu_pad, **place)


def gated_deltanet_spec(args):
    """The ``ModuleSpec`` of a Gated DeltaNet layer's token mixer for ``args`` (``args.linear_attention`` set).

    >>> from packfwd.models.mixers import DeltaNet
    >>> from types import SimpleNamespace
    >>> spec = gated_deltanet_spec(SimpleNamespace(linear_attention=DeltaNet(1, 2, 4, 4, layers=(0,))))
    >>> spec.module.__name__, spec.params["deltanet"].num_v_heads
    ('PackedGatedDeltaNet', 2)
    """
    from megatron.core.transformer.spec_utils import ModuleSpec

    return ModuleSpec(module=PackedGatedDeltaNet, params={"deltanet": args.linear_attention})
