"""The layer spec of packfwd's models, derived from their :class:`~packfwd.models.args.ModelArgs` (its family's
entry, :mod:`packfwd.models.families.family`): Megatron-Core's own ``TransformerLayer`` and ``SelfAttention`` with
Megatron's tensor-parallel linears, and packfwd's :class:`~packfwd.models.mixers.attention.CoreAttention` as the one
swapped-in submodule; its spec params carry the attention backend and the model's THD RoPE
(:class:`~packfwd.models.mixers.rope.PackedRope`).

Per layer (names as in the state dict)::

    input_layernorm        RMSNorm
    self_attention         SelfAttention (causal)
      linear_qkv           ColumnParallelLinear, fused [q, k, v] grouped by query group (bias: add_qkv_bias)
      q_layernorm          RMSNorm over head_dim with QK-norm (args.qk_norm: Qwen3), else IdentityOp
      k_layernorm          likewise
      core_attention       packfwd CoreAttention (THD via PackedSeqParams, or BSHD); params: backend, rope
      linear_proj          RowParallelLinear
    self_attention         with multi-head latent attention (args.mla, DeepSeek-V3) instead: packfwd's
                           PackedMLASelfAttention with Megatron-Core's MLA submodules (packfwd.models.mixers.mla)
    pre_mlp_layernorm      RMSNorm
    mlp                    MLP, gated (SwiGLU): linear_fc1 = [gate; up] ColumnParallelLinear, linear_fc2 Row...;
                           a layer with a Mixture of Experts (args.moe): the spec of its registered MLP kind

Fused (``args.fused``, the default): the MLP's activation is :class:`packfwd.ops.swiglu.SwiGLU` (named in the spec
always; Megatron-Core builds it only under ``config.use_te_activation_func``, which ``transformer_config`` sets from
``args.fused``), the THD RoPE the model hands the core attention is fused (:mod:`packfwd.models.mixers.rope`), and
QK-norm (Qwen3) is :class:`FusedRMSNorm`.  Same parameters, same state dict; on the CPU the same numbers bit for
bit (each falls back to the plain module's torch ops).  ``fused=False``: Megatron-Core's plain modules.  The layer
norms stay :class:`RMSNorm` either way: over the hidden size torch's own ``rms_norm`` is one fused CUDA kernel at
least as fast as the Triton kernels on an H200 (RESULTS sections 11 and 15); QK-norm's rows of head_dim channels
go many to a Triton program, where torch's kernel is slow (``FUSED_NORMS``).

Megatron-Core is imported inside the functions only.
"""

from __future__ import annotations

import torch

__all__ = ["FusedRMSNorm", "RMSNorm", "block_spec", "layer_spec", "mla_attention_spec", "mlp_spec"]


class RMSNorm(torch.nn.RMSNorm):
    """``torch.nn.RMSNorm`` built the way Megatron-Core builds a norm: ``(config=, hidden_size=, eps=)``.

    Parameters take ``config.params_dtype``, and are marked ``sequence_parallel`` under sequence parallelism
    (each rank then sees a slice of the tokens, so Megatron all-reduces their gradients over the TP group).

    ``fused=True`` (:class:`FusedRMSNorm`, for a spec that names it) computes the norm with the Triton kernels of
    :mod:`packfwd.ops.rmsnorm` where they take the input (CUDA, bf16 / fp16 / fp32), else as torch does; same
    math, equal within float32 rounding.

    >>> from types import SimpleNamespace
    >>> import torch
    >>> norm = RMSNorm(SimpleNamespace(params_dtype=torch.float32, sequence_parallel=False), hidden_size=4, eps=1e-6)
    >>> norm(torch.ones(2, 4))
    tensor([[1.0000, 1.0000, 1.0000, 1.0000],
            [1.0000, 1.0000, 1.0000, 1.0000]], grad_fn=<MulBackward0>)
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, fused: bool = False, **unused):
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.fused = bool(fused)
        if getattr(config, "sequence_parallel", False):
            for p in self.parameters():
                p.sequence_parallel = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and self.weight is not None:
            from packfwd.ops import rmsnorm

            if rmsnorm.supported(x, self.weight):
                eps = torch.finfo(x.dtype).eps if self.eps is None else self.eps
                return rmsnorm.rms_norm(x, self.weight, eps, kernel=True)
        return super().forward(x)


class FusedRMSNorm(RMSNorm):
    """:class:`RMSNorm` with ``fused=True``, for a spec that names it (packfwd's fused models keep :class:`RMSNorm`:
    torch's own fused kernel is faster, see the module docstring).  A class of its own, not a spec param, because
    Megatron-Core 0.19 builds norms by calling the spec's class directly.

    >>> from types import SimpleNamespace
    >>> FusedRMSNorm(SimpleNamespace(params_dtype=torch.float32), hidden_size=4, eps=1e-6).fused
    True
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-5, **unused):
        super().__init__(config, hidden_size, eps, fused=True)


# The norm each place of a fused model takes: "torch" (:class:`RMSNorm`: torch's rms_norm) or "kernel"
# (:class:`FusedRMSNorm`: packfwd's Triton kernels, several rows to a program).  The layer norms over the hidden
# size keep torch's; QK-norm's narrow rows (head_dim) take the kernels.  Measured per place on an H200
# (``benchmarks/bench_kernels.py``'s rmsnorm / qk_norm rows, ``bench_step.py``'s packfwd_fused_*_norms variants).
FUSED_NORMS = {"layer": "torch", "qk": "kernel"}


def _norm(args, place: str = "layer"):
    """The norm class of ``place`` ("layer" or "qk") in a model of ``args``: :class:`FusedRMSNorm` where the model
    is fused and ``FUSED_NORMS`` picks the kernels there, else :class:`RMSNorm` (module docstring)."""
    if args is not None and getattr(args, "fused", False) and FUSED_NORMS[place] == "kernel":
        return FusedRMSNorm
    return RMSNorm


def layer_spec(args=None, layer: int = 0, *, attention_backend: str | None = None, rope=None):
    """The ``ModuleSpec`` of global decoder layer ``layer`` (0-based) of a model of ``args`` (see the module
    docstring; None: a Llama layer, no QK-norm and a dense MLP).

    ``attention_backend`` and ``rope`` are the params of :class:`~packfwd.models.mixers.attention.CoreAttention`: its
    varlen backend (None: automatic) and the RoPE it applies to THD batches (a
    :class:`~packfwd.models.mixers.rope.PackedRope` shared by all layers; None: q and k arrive rotated).

    >>> spec = layer_spec(attention_backend="reference")
    >>> core = spec.submodules.self_attention.submodules.core_attention
    >>> core.module.__name__, core.params
    ('CoreAttention', {'backend': 'reference', 'rope': None})
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    qk_norm = _norm(args, "qk") if args is not None and args.qk_norm else IdentityOp

    if getattr(args, "mla", None) is not None:  # multi-head latent attention: rope is its MlaRope
        attention = mla_attention_spec(args, attention_backend=attention_backend, rope=rope)
    else:
        attention = _gqa_spec(qk_norm, attention_backend, rope)
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=_norm(args),
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=_norm(args),
            mlp=mlp_spec(args, layer),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def _gqa_spec(qk_norm, attention_backend, rope):
    """Megatron-Core's ``SelfAttention`` (fused QKV, grouped-query) with packfwd's core attention."""
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.attention import SelfAttention, SelfAttentionSubmodules
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ..mixers.attention import CoreAttention

    return ModuleSpec(
        module=SelfAttention,
        params={"attn_mask_type": AttnMaskType.causal},
        submodules=SelfAttentionSubmodules(
            linear_qkv=ColumnParallelLinear,
            core_attention=ModuleSpec(module=CoreAttention, params={"backend": attention_backend, "rope": rope}),
            linear_proj=RowParallelLinear,
            q_layernorm=qk_norm,
            k_layernorm=qk_norm,
        ),
    )


def mla_attention_spec(args, *, attention_backend: str | None = None, rope=None):
    """The ``ModuleSpec`` of an MLA layer's self-attention for ``args`` (``args.mla`` set): Megatron-Core's local
    MLA submodules (column-parallel down projections, RMSNorm latent norms), packfwd's core attention without RoPE;
    ``rope`` the model's :class:`~packfwd.models.mixers.mla.MlaRope` (None: the module builds one from the config).

    >>> from packfwd.models.args import ModelArgs
    >>> from packfwd.models.mixers.latent import Mla
    >>> args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=2,
    ...                  family="deepseek_v3", mla=Mla(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4,
    ...                  v_head_dim=6))
    >>> spec = mla_attention_spec(args)
    >>> spec.module.__name__, spec.submodules.core_attention.params
    ('PackedMLASelfAttention', {'backend': None, 'rope': None})
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.multi_latent_attention import MLASelfAttentionSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from ..mixers.attention import CoreAttention
    from ..mixers.mla import PackedMLASelfAttention

    return ModuleSpec(
        module=PackedMLASelfAttention,
        params={"attn_mask_type": AttnMaskType.causal, "mla": args.mla, "rope": rope},
        submodules=MLASelfAttentionSubmodules(
            linear_q_proj=ColumnParallelLinear, linear_q_down_proj=ColumnParallelLinear,
            linear_q_up_proj=ColumnParallelLinear, linear_kv_down_proj=ColumnParallelLinear,
            linear_kv_up_proj=ColumnParallelLinear,
            core_attention=ModuleSpec(module=CoreAttention, params={"backend": attention_backend, "rope": None}),
            linear_proj=RowParallelLinear, q_layernorm=RMSNorm, kv_layernorm=RMSNorm,
        ),
    )


def mlp_spec(args=None, layer: int = 0):
    """The ``ModuleSpec`` of global layer ``layer``'s MLP: gated SwiGLU where ``args.dense_mlp(layer)`` (or
    ``args`` is None), else what the MLP kind registered for ``args.moe`` builds
    (:func:`packfwd.models.families.family.mlp_kind`).  The activation module (:class:`packfwd.ops.swiglu.SwiGLU`) is
    built only in a fused model (module docstring).

    >>> mlp_spec().submodules.linear_fc1.__name__, mlp_spec().submodules.activation_func.__name__
    ('ColumnParallelLinear', 'SwiGLU')
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.spec_utils import ModuleSpec

    from packfwd.ops.swiglu import SwiGLU
    from ..families.family import mlp_kind

    if args is None or args.dense_mlp(layer):
        return ModuleSpec(module=MLP, submodules=MLPSubmodules(
            linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear, activation_func=SwiGLU))
    return mlp_kind(args.moe).layer_spec(args, layer)


def block_spec(layers, *, args=None, attention_backend: str | None = None, rope=None):
    """``TransformerBlockSubmodules`` with the global layers ``layers`` (0-based; an int ``n``: ``range(n)``) of a
    model of ``args`` (:func:`layer_spec`), and the final RMSNorm.

    Giving the block its layers explicitly (instead of one layer spec that Megatron-Core repeats) fixes the
    final norm to :class:`RMSNorm` whatever extensions are installed, lets each layer be built from its own
    spec (a dense layer among Mixture-of-Experts ones), and lets the pipeline-stage builder state the layer
    count it expects from ``packfwd.layers.layer_partition``.

    >>> block = block_spec(3)
    >>> len(block.layer_specs), block.layer_norm.__name__
    (3, 'RMSNorm')
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = range(layers) if isinstance(layers, int) else layers
    specs = [layer_spec(args, i, attention_backend=attention_backend, rope=rope) for i in layers]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=_norm(args))
