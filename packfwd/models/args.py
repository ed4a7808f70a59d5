"""The architecture of one decoder in one frozen dataclass (:class:`ModelArgs`: its family's name and its numbers).

Each field belongs to one owner, which checks it and says what it becomes: the model's own (sizes, norm eps, RoPE
theta, biases on every linear, embeddings, value head, MTP depths, ``norm_zero_centered``, ``fused``), the token mixer's
(:mod:`packfwd.models.mixers`: softmax attention's ``num_query_groups``, ``head_dim``, ``qkv_bias``, ``qk_norm``,
``rotary_percent``, ``rope_scaling_factor``, ``mrope_section``, ``mrope_interleaved``, ``attention_windows``,
``attention_sinks``, ``rope_yarn``; latent attention's ``mla``; gated attention's ``attention_output_gate``; Gated
DeltaNet's ``linear_attention``, the layers of a hybrid model that have it) and the MLP's
(:mod:`packfwd.models.mlp`: ``ffn_hidden_size``; ``moe``).  ``__post_init__`` checks the model's fields and asks
the layer components to check theirs; nothing here branches on a component's kind.  No Megatron-Core.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .families import FAMILIES, family
from .mixers import Mla, Yarn, mixer, mixers
from .mlp import DENSE, mlp_kind

__all__ = ["ModelArgs"]


@dataclass(frozen=True)
class ModelArgs:
    """The architecture of a decoder: ``family`` names its entry of :data:`packfwd.models.families.FAMILIES` (its
    layer components, its HF names and config reading), the other fields its numbers and per-model choices (module
    docstring: which component owns which field).

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2)
    >>> args.kv_channels, args.query_groups
    (16, 2)
    >>> ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=4,
    ...           family="qwen2", qkv_bias=True).qkv_bias
    True
    """

    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int | None = None  # None: one kv head per query head (no GQA)
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling_factor: float | None = None  # Llama-3.x frequency scaling (low 1, high 4, original 8192)
    rotary_percent: float = 1.0  # partial RoPE: the first int(head_dim * this) channels of each head rotate (GLM-4.5)
    qkv_bias: bool = False  # a bias on q, k, v only (Qwen2)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    linear_bias: bool = False  # a bias on every linear (Llama with attention_bias and mlp_bias)
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    value_head: bool = False  # output layer of width 1 (a critic / reward model)
    value_head_bias: bool = False
    mtp_num_layers: int = 0  # multi-token prediction depths (DeepSeek-V3's MTP), built on the last stage
    mtp_loss_scaling_factor: float = 0.1  # Megatron-Core's weight of the MTP loss (Megatron's default)
    mrope_section: tuple[int, int, int] | None = None  # Qwen2-VL multimodal RoPE: (t, h, w) frequencies, sum d/2
    #  (partial RoPE: half the rotated channels)
    mrope_interleaved: bool = False  # the sections' frequencies interleaved t, h, w, t, h, w, ... (Qwen3-VL, Qwen3.5)
    family: str = "llama"  # the entry of packfwd.models.families.FAMILIES: its HF names and config reading
    moe: Any = None  # a Mixture-of-Experts MLP (Moe; but on moe.dense_layers); None: dense SwiGLU everywhere
    mla: Mla | None = None  # multi-head latent attention (DeepSeek-V3; packfwd.models.mixers.latent); None: softmax
    attention_windows: tuple[int | None, ...] | None = None  # per layer: a sliding window of W tokens (a query and
    #  the W - 1 before it, transformers' sliding_window) or None (full); None: every layer full (GPT-OSS)
    attention_sinks: bool = False  # a learned logit per head in every softmax denominator (GPT-OSS's sinks)
    rope_yarn: Yarn | None = None  # YaRN RoPE scaling of softmax attention (GPT-OSS)
    attention_output_gate: bool = False  # attention output times sigmoid(a gate q_proj also emits) (Qwen3-Next, 3.5)
    linear_attention: Any = None  # linear-attention layers (hybrids): Gated DeltaNet (DeltaNet) or Kimi Delta
    #  Attention (Kda): sizes, which layers; None: none
    norm_zero_centered: bool = False  # every RMSNorm computes rms_norm(x) * (1 + weight) (Qwen3-Next, Qwen3.5)
    fused: bool = True  # packfwd's fused kernels on CUDA (RMSNorm, SwiGLU, THD RoPE; same weights, numbers within
    #  rounding, the torch path elsewhere); False: Megatron-Core's plain modules, for checking

    def __post_init__(self):
        entry = family(self.family)
        if not isinstance(self.fused, bool):
            raise TypeError(f"ModelArgs.fused must be True (packfwd's fused kernels) or False (Megatron-Core's plain "
                            f"modules), got {self.fused!r}")
        for name in ("vocab_size", "hidden_size", "ffn_hidden_size", "num_layers", "num_attention_heads",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelArgs.{name} must be a positive int, got {value!r}")
        if isinstance(self.mtp_num_layers, bool) or not isinstance(self.mtp_num_layers, int) or self.mtp_num_layers < 0:
            raise ValueError(f"ModelArgs.mtp_num_layers must be an int >= 0 (0: no MTP), got {self.mtp_num_layers!r}")
        if self.mtp_num_layers and self.value_head:
            raise ValueError("a value model (value_head=True) has no vocabulary head to predict tokens with; "
                             "use mtp_num_layers=0")
        for name in ("norm_zero_centered", "attention_output_gate"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"ModelArgs.{name} must be True or False, got {getattr(self, name)!r}")
        self._check_mixer(entry)
        for own in mixers(self):  # the model's token mixer, and a hybrid's other one (its linear attention)
            own.check(self)
        DENSE.check(self)
        if self.moe is not None:
            try:
                kind = mlp_kind(self.moe)
            except NotImplementedError:  # refused when the model is built, naming the fix (mlp_kind)
                return
            if hasattr(kind, "check"):
                kind.check(self)

    def _check_mixer(self, entry) -> None:
        """The token mixer the fields describe is the family's."""
        if self.linear_attention is not None and entry.linear_attention is None:
            hybrids = sorted(name for name, f in FAMILIES.items() if f.linear_attention is not None)
            raise ValueError(f"linear_attention given for family={self.family!r}, which has no linear-attention "
                             f"layers; pass family={' or '.join(repr(h) for h in hybrids)} or linear_attention=None")
        linear = [m for m in mixers(self) if "linear_attention" in m.fields]
        if linear and linear[0] is not entry.linear_attention:
            raise ValueError(f"linear_attention={type(self.linear_attention).__name__}(...) for family={self.family!r}, "
                             f"whose linear attention is {entry.linear_attention.name}; pass its description")
        own = mixer(self)
        if own is entry.attention:
            return
        if getattr(entry.attention, "field", None) is not None:
            raise ValueError(f"family={self.family!r} has {entry.attention.name}: pass {entry.attention.hint}, e.g. "
                             "through args_from_hf_config")
        others = sorted(name for name, f in FAMILIES.items() if f.attention is own)
        raise ValueError(f"{own.field} given for family={self.family!r}, whose attention is {entry.attention.name}; "
                         f"pass family={' or '.join(repr(o) for o in others)} or {own.field}=None")

    def dense_mlp(self, layer: int) -> bool:
        """Whether global layer ``layer`` (0-based) has a dense SwiGLU MLP (else the MLP ``moe`` describes)."""
        return self.moe is None or layer in self.moe.dense_layers

    @property
    def kv_channels(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_attention_heads

    @property
    def query_groups(self) -> int:
        return self.num_query_groups if self.num_query_groups is not None else self.num_attention_heads
