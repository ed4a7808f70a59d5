"""A model family as one declarative entry: what its layers are, and how to read them from a transformers config.

A :class:`Family` says what every model of a transformers ``model_type`` shares (the norm, QK-norm, which
linears carry a bias, the RoPE scalings it converts, whether its MLP is a Mixture of Experts and how to read
that) and :meth:`Family.hf_fields` reads one model's numbers from its HF config.  The entries live in one table,
:data:`FAMILIES`; everything else is derived from an entry and the model's numbers (a :class:`ModelArgs
<packfwd.models.args.ModelArgs>` naming the entry in ``family``):

* Megatron-Core's ``TransformerConfig``: :func:`packfwd.models.args.transformer_config`;
* packfwd's ``ModuleSpec`` of each layer: :func:`packfwd.models.runtime.spec.layer_spec`;
* the weight mapping both ways: :mod:`packfwd.models.convert.hf_weights`;
* ``from_hf`` / ``args_from_hf_config`` / ``to_hf_state_dict``: :mod:`packfwd.models.convert.hf`.

**Adding a dense family** whose layers are built from the choices below is one entry in :data:`FAMILIES`.

**MLP kinds.**  A dense SwiGLU MLP (``ModelArgs.moe=None``, and the layers ``Moe.dense_layers``) is built in
:mod:`packfwd.models.runtime.spec`.  Any other MLP is described by a frozen dataclass (:class:`Moe`) and built by the
:class:`MlpKind` registered for its type with :func:`register_mlp_kind`: its Megatron-Core config fields, its
layer spec and its weight mapping.  :func:`mlp_kind` looks it up (``NotImplementedError`` naming the fix when
none is registered).  Megatron-Core is not imported here.  (A little over 300 lines: the MoE description, the
family entry and the MLP-kind protocol are the one vocabulary a new family is written in.)
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

__all__ = ["FAMILIES", "Family", "MlpKind", "Moe", "family", "family_of_hf_config", "mlp_kind", "register_mlp_kind"]


@dataclass(frozen=True)
class Moe:
    """A Mixture-of-Experts MLP: a router choosing ``top_k`` of ``num_experts`` SwiGLU experts per token, dropless
    (no capacity factor: a token's output never depends on its batch).

    >>> Moe(num_experts=8, top_k=2, ffn_hidden_size=32, dense_layers=[0]).dense_layers
    (0,)
    """

    num_experts: int  # routed experts (HF num_experts / num_local_experts / n_routed_experts)
    top_k: int  # experts per token (num_experts_per_tok)
    ffn_hidden_size: int  # each routed expert's hidden width (moe_intermediate_size; Mixtral: intermediate_size)
    score_function: str = "softmax"  # "softmax" (Qwen3-MoE, Mixtral) or "sigmoid" (DeepSeek-V3)
    normalize_top_k: bool = True  # the k chosen probabilities rescaled to sum to 1 (norm_topk_prob)
    shared_ffn_hidden_size: int = 0  # hidden width of the shared expert(s) every token also goes through; 0: none
    shared_expert_gate: bool = False  # a sigmoid gate on the shared expert's output (Qwen2-MoE)
    dense_layers: tuple[int, ...] = ()  # 0-based layers whose MLP is dense SwiGLU (ModelArgs.ffn_hidden_size)
    expert_bias: bool = False  # a routing-only bias added to the scores (DeepSeek-V3's e_score_correction_bias)
    num_groups: int | None = None  # group-limited routing: experts in num_groups groups (n_group) ...
    group_top_k: int | None = None  # ... of which each token searches its best group_top_k (topk_group)
    scaling_factor: float | None = None  # the routed probabilities times this (routed_scaling_factor)
    router_dtype: str | None = None  # "fp32"/"fp64": the gate weight kept in float32 (at least) and its logits
    #  computed in that dtype (transformers' GLM-4.5 / DeepSeek-V3); None: the model's dtype (Qwen3-MoE, Mixtral)

    def __post_init__(self):
        for name in ("num_experts", "top_k", "ffn_hidden_size"):
            _check_int(f"Moe.{name}", getattr(self, name), 1)
        _check_int("Moe.shared_ffn_hidden_size", self.shared_ffn_hidden_size, 0)
        if self.shared_expert_gate and not self.shared_ffn_hidden_size:
            raise ValueError("Moe.shared_expert_gate=True gates a shared expert: give it a width "
                             "(shared_ffn_hidden_size > 0) or pass shared_expert_gate=False")
        if self.top_k > self.num_experts:
            raise ValueError(f"Moe.top_k={self.top_k} exceeds num_experts={self.num_experts}")
        if self.score_function not in ("softmax", "sigmoid"):
            raise ValueError(f"Moe.score_function={self.score_function!r}: pass 'softmax' or 'sigmoid'")
        if self.router_dtype not in (None, "fp32", "fp64"):
            raise ValueError(f"Moe.router_dtype={self.router_dtype!r}: pass 'fp32', 'fp64' or None (the model's dtype)")
        layers = tuple(self.dense_layers)
        for i in layers:
            _check_int("Moe.dense_layers entry", i, 0)
        if list(layers) != sorted(set(layers)):
            raise ValueError(f"Moe.dense_layers={self.dense_layers!r}: pass increasing layer indices")
        object.__setattr__(self, "dense_layers", layers)
        if (self.num_groups is None) != (self.group_top_k is None):
            raise ValueError("Moe.num_groups and Moe.group_top_k come together (group-limited routing) or not at all")
        if self.num_groups is not None:
            _check_int("Moe.num_groups", self.num_groups, 1)
            _check_int("Moe.group_top_k", self.group_top_k, 1)
            if self.num_experts % self.num_groups or self.group_top_k > self.num_groups:
                raise ValueError(f"Moe.num_groups={self.num_groups} must divide num_experts={self.num_experts} and "
                                 f"be at least group_top_k={self.group_top_k}")


def _check_int(name: str, value, low: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise ValueError(f"{name} must be an int >= {low}, got {value!r}")


@dataclass(frozen=True)
class Family:
    """What every model of one transformers family shares, and how to read a model's numbers from its config.

    ``head_dim`` is read the same way for every family: the config's ``head_dim`` when set (Qwen3's is explicit,
    and ``heads * head_dim`` need not be ``hidden_size``), else ``hidden_size // num_attention_heads``; tied
    embeddings from ``tie_word_embeddings``, else ``tie_embeddings``.

    >>> FAMILIES["qwen2"].qkv_bias, FAMILIES["llama"].linear_bias_flags
    (True, ('attention_bias', 'mlp_bias'))
    """

    name: str  # the key in FAMILIES, and ModelArgs.family
    hf_model_types: tuple[str, ...]  # the transformers config model_type(s) it converts
    norm: str = "rmsnorm"  # every norm (packfwd builds RMSNorm only)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before RoPE (HF q_norm/k_norm; Megatron qk_layernorm)
    qkv_bias: bool = False  # a bias on q, k and v only, always (Qwen2)
    qkv_bias_flag: str | None = None  # the HF flag putting a bias on q, k, v only (GLM-4.5's attention_bias);
    #                                   qkv_bias is its value when a config lacks it
    qk_norm_flag: str | None = None  # the HF flag turning QK-norm on (GLM-4.5's use_qk_norm); None: qk_norm
    partial_rope: bool = False  # rope_parameters["partial_rotary_factor"] is read (ModelArgs.rotary_percent)
    linear_bias_flags: tuple[str, ...] = ()  # HF flags putting a bias on every linear (must be equal: Megatron's
    #                                          add_bias_linear is one switch)
    unsupported: tuple[tuple[str, str], ...] = ()  # (HF flag, why and what to do): refused when the flag is set
    rope_scalings: tuple[str, ...] = ("default", "llama3")  # HF rope_type values it converts
    tie_embeddings: bool = False  # when the config does not say (tie_word_embeddings)
    read_moe: Callable[[Any], Moe] | None = None  # the MoE description of a config; None: dense SwiGLU MLPs
    mrope: bool = False  # multimodal RoPE (Qwen2-VL): rope_parameters["mrope_section"]; the text under text_config
    read_mla: Callable[[Any], Any] | None = None  # the multi-head latent attention (packfwd.models.mixers.latent.Mla) of
    #                                              a config (DeepSeek-V3); None: grouped-query attention

    def __post_init__(self):
        if self.norm != "rmsnorm":
            raise ValueError(f"Family {self.name!r}: norm={self.norm!r}; packfwd builds 'rmsnorm' only")

    def hf_fields(self, cfg) -> dict:
        """The :class:`~packfwd.models.args.ModelArgs` fields of the transformers config ``cfg`` (all but the
        value head's); ValueError for what packfwd cannot build.

        >>> from transformers import LlamaConfig
        >>> cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        ...                   num_key_value_heads=2, vocab_size=64, attention_bias=True, mlp_bias=True)
        >>> fields = FAMILIES["llama"].hf_fields(cfg)
        >>> fields["family"], fields["head_dim"], fields["qkv_bias"], fields["linear_bias"]
        ('llama', 8, False, True)
        """
        text = getattr(cfg, "text_config", None) or cfg  # a vision-language config holds its decoder's there
        tied = getattr(cfg, "tie_word_embeddings", getattr(text, "tie_word_embeddings", self.tie_embeddings))
        fields = self._text_fields(text)
        fields["tie_embeddings"] = bool(tied)
        if self.mrope:
            fields["mrope_section"] = self._mrope_section(text)
        return fields

    def _text_fields(self, cfg) -> dict:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act={cfg.hidden_act!r}: packfwd's MLP is SwiGLU (silu); use 'silu'")
        for flag, why in self.unsupported:
            if getattr(cfg, flag, False):
                raise ValueError(f"{flag}={getattr(cfg, flag)!r}: {why}")
        if getattr(cfg, "attention_dropout", 0.0):  # transformers applies it in train mode; packfwd builds none
            raise ValueError(f"attention_dropout={cfg.attention_dropout!r}: packfwd builds attention without dropout "
                             "(the training step would differ from transformers'); set attention_dropout=0.0")
        theta, factor = self._rope(cfg)
        heads = cfg.num_attention_heads
        mla = self.read_mla(cfg) if self.read_mla is not None else None
        qkv_bias = bool(getattr(cfg, self.qkv_bias_flag, self.qkv_bias)) if self.qkv_bias_flag else self.qkv_bias
        qk_norm = bool(getattr(cfg, self.qk_norm_flag, False)) if self.qk_norm_flag else self.qk_norm
        return dict(
            family=self.name,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            ffn_hidden_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_attention_heads=heads,
            num_query_groups=heads if mla is not None else getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=mla.qk_head_dim if mla is not None else getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            norm_eps=cfg.rms_norm_eps,
            rope_theta=theta,
            rope_scaling_factor=factor,
            rotary_percent=self._rotary_percent(cfg),
            qkv_bias=qkv_bias,
            qk_norm=qk_norm,
            linear_bias=self._linear_bias(cfg),
            max_position_embeddings=cfg.max_position_embeddings,
            moe=self.read_moe(cfg) if self.read_moe is not None else None,
            mla=mla,
        )

    def _linear_bias(self, cfg) -> bool:
        values = {flag: bool(getattr(cfg, flag, False)) for flag in self.linear_bias_flags}
        if len(set(values.values())) > 1:
            raise ValueError(
                f"{', '.join(f'{k}={v}' for k, v in values.items())}: Megatron-Core puts a bias on all linears or on "
                "none (add_bias_linear), so both must be equal"
            )
        return any(values.values())

    def _rope(self, cfg) -> tuple[float, float | None]:
        """(theta, Llama-3 scaling factor or None) of the config's RoPE."""
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in self.rope_scalings:
            raise ValueError(f"rope_type={kind!r} is not supported; packfwd converts "
                             f"{' and '.join(repr(k) for k in self.rope_scalings)} RoPE for {self.name}")
        if kind in ("default", "mrope"):  # "mrope": multimodal RoPE without frequency scaling (Qwen2-VL)
            return theta, None
        if kind == "yarn":  # read into ModelArgs.mla by read_mla (only MLA families list it)
            if self.read_mla is None:
                raise ValueError(f"rope_type='yarn' for {self.name}: packfwd builds YaRN for multi-head latent "
                                 "attention only")
            return theta, None
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(float(params.get(k, v)) != v for k, v in expected.items()):
            raise ValueError(f"llama3 RoPE scaling {params}: Megatron-Core supports low_freq_factor=1, "
                             "high_freq_factor=4, original_max_position_embeddings=8192 only")
        return theta, float(params["factor"])

    def _rotary_percent(self, cfg) -> float:
        """The fraction of each head's channels RoPE rotates: the config's ``partial_rotary_factor`` where the
        family reads it (transformers' GLM-4.5 rotates ``int(head_dim * factor)`` channels), else 1."""
        if not self.partial_rope:
            return 1.0
        params = getattr(cfg, "rope_parameters", None) or {}
        return float(params.get("partial_rotary_factor", getattr(cfg, "partial_rotary_factor", None) or 1.0))

    @staticmethod
    def _mrope_section(cfg) -> tuple[int, ...]:
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if params.get("mrope_section") is None:
            raise ValueError("the config has no rope_parameters['mrope_section']; a Qwen2-VL language model needs one")
        return tuple(params["mrope_section"])


_FULL_CAUSAL = ("use_sliding_window", "packfwd's attention is full causal; set it to False")
_QWEN3_ATTENTION_BIAS = (
    "attention_bias", "Qwen3's attention_bias puts a bias on q, k, v and o but none on the MLP; Megatron-Core "
    "biases all linears or none (add_bias_linear), so packfwd builds Qwen3 with attention_bias=False")


def _qwen3_moe(cfg) -> Moe | None:
    """Qwen3-MoE's MLPs: layer ``i`` is dense when in ``mlp_only_layers`` or ``(i + 1) % decoder_sparse_step``."""
    dense = tuple(i for i in range(cfg.num_hidden_layers)
                  if i in (cfg.mlp_only_layers or ()) or (i + 1) % cfg.decoder_sparse_step)
    if not cfg.num_experts or len(dense) == cfg.num_hidden_layers:
        return None  # every MLP dense
    return Moe(num_experts=cfg.num_experts, top_k=cfg.num_experts_per_tok, ffn_hidden_size=cfg.moe_intermediate_size,
               normalize_top_k=bool(cfg.norm_topk_prob), dense_layers=dense)


def _qwen2_moe(cfg) -> Moe | None:
    """Qwen2-MoE's MLPs: Qwen3-MoE's layout of dense and MoE layers, and in each MoE layer one shared expert of
    width ``shared_expert_intermediate_size`` gated by a sigmoid (``shared_expert_gate``)."""
    moe = _qwen3_moe(cfg)
    if moe is None:
        return None
    if not cfg.shared_expert_intermediate_size:
        raise ValueError("shared_expert_intermediate_size=0: a Qwen2-MoE layer always has its gated shared expert; "
                         "give it a width, or convert the model as qwen3_moe (no shared expert)")
    return dataclasses.replace(moe, shared_ffn_hidden_size=cfg.shared_expert_intermediate_size,
                               shared_expert_gate=True)


def _mixtral(cfg) -> Moe:
    """Mixtral's MLPs: every layer softmax top-k, renormalised, experts as wide as ``intermediate_size``."""
    return Moe(num_experts=cfg.num_local_experts, top_k=cfg.num_experts_per_tok,
               ffn_hidden_size=cfg.intermediate_size)


def _deepseek_mla(cfg):
    """DeepSeek-V3's multi-head latent attention (:func:`packfwd.models.mixers.latent.mla_from_hf_config`)."""
    from ..mixers.latent import mla_from_hf_config

    return mla_from_hf_config(cfg)


def _deepseek_moe(cfg) -> Moe | None:
    """DeepSeek-V3-style MLPs (GLM-4.5): sigmoid scores with a correction bias, group-limited top-k, shared
    experts, the first ``first_k_dense_replace`` layers dense (:func:`packfwd.models.mlp.moe_weights.deepseek_moe_fields`)."""
    from ..mlp.moe_weights import deepseek_moe_fields

    fields = deepseek_moe_fields(cfg)
    return Moe(**fields) if fields is not None else None


# The families packfwd builds and converts, one entry each.
FAMILIES: dict[str, Family] = {
    f.name: f
    for f in (
        Family("llama", ("llama",), linear_bias_flags=("attention_bias", "mlp_bias")),
        Family("qwen2", ("qwen2",), qkv_bias=True, unsupported=(_FULL_CAUSAL,)),
        Family("qwen2_vl", ("qwen2_vl", "qwen2_5_vl", "qwen2_vl_text", "qwen2_5_vl_text"), qkv_bias=True,
               unsupported=(_FULL_CAUSAL,), rope_scalings=("default", "mrope"), mrope=True),
        Family("qwen3", ("qwen3",), qk_norm=True, unsupported=(_FULL_CAUSAL, _QWEN3_ATTENTION_BIAS)),
        Family("qwen3_moe", ("qwen3_moe",), qk_norm=True, unsupported=(_FULL_CAUSAL, _QWEN3_ATTENTION_BIAS),
               read_moe=_qwen3_moe),
        Family("qwen2_moe", ("qwen2_moe",), qkv_bias=True, qkv_bias_flag="qkv_bias", unsupported=(_FULL_CAUSAL,),
               read_moe=_qwen2_moe),
        Family("mixtral", ("mixtral",), read_moe=_mixtral, unsupported=(
            ("sliding_window", "packfwd's attention is full causal; set sliding_window=None"),
            ("router_jitter_noise", "packfwd's router adds no jitter (Megatron-Core's would also jitter in eval); "
                                    "set router_jitter_noise=0.0"))),
        Family("glm4_moe", ("glm4_moe",), qkv_bias_flag="attention_bias", qk_norm_flag="use_qk_norm",
               partial_rope=True, read_moe=_deepseek_moe),
        Family("deepseek_v3", ("deepseek_v3",), read_moe=_deepseek_moe, read_mla=_deepseek_mla,
               rope_scalings=("default", "yarn"), unsupported=(
                   ("attention_bias", "packfwd builds MLA's projections without biases (Megatron-Core's MLA has "
                                      "none on its down projections); set attention_bias=False"),)),
    )
}


def family(name: str) -> Family:
    """The entry of :data:`FAMILIES` called ``name``.

    >>> family("qwen2").hf_model_types
    ('qwen2',)
    """
    if name not in FAMILIES:
        raise ValueError(f"family={name!r} is not one of packfwd's model families {sorted(FAMILIES)}")
    return FAMILIES[name]


def family_of_hf_config(cfg) -> Family:
    """The entry whose ``hf_model_types`` holds the transformers config's ``model_type``.

    >>> from transformers import LlamaConfig
    >>> family_of_hf_config(LlamaConfig()).name
    'llama'
    """
    kind = getattr(cfg, "model_type", None)
    for entry in FAMILIES.values():
        if kind in entry.hf_model_types:
            return entry
    supported = tuple(t for entry in FAMILIES.values() for t in entry.hf_model_types)
    raise ValueError(f"model_type={kind!r} is not supported; packfwd converts {supported}")


class MlpKind(Protocol):
    """How packfwd builds and converts the MLPs one description type (:class:`Moe`) describes: what
    :func:`register_mlp_kind` takes.  ``args`` is the model's :class:`~packfwd.models.args.ModelArgs`, its
    ``moe`` the description; a layer in ``args.moe.dense_layers`` never reaches the kind."""

    def config_fields(self, args) -> dict:
        """Megatron-Core ``TransformerConfig`` fields for ``args`` (added to :func:`transformer_config`'s)."""

    def layer_spec(self, args, layer: int):
        """The ``ModuleSpec`` of the MLP of global layer ``layer`` (0-based; an MTP layer is ``num_layers``)."""

    def hf_to_megatron(self, args, hf_state_dict: Mapping, hf_layer: str, mg_layer: str, *, tp_size: int,
                       tp_rank: int) -> dict:
        """TP rank ``tp_rank``'s Megatron tensors of one layer's MLP: names under ``hf_layer``
        (``"model.layers.3."``) become names under ``mg_layer`` (``"decoder.layers.1."``); new tensors."""

    def megatron_to_hf(self, args, shards: Sequence[Mapping], mg_layer: str, hf_layer: str) -> dict:
        """The inverse: the HF tensors of one layer's MLP from every TP rank's state dict, in rank order."""


class _MoeKindOnUse:
    """The built-in kind of :class:`Moe`: :class:`packfwd.models.mlp.moe.MoeKind`, imported when first used."""

    def __getattr__(self, name: str):
        from ..mlp.moe import MoeKind

        return getattr(MoeKind(), name)


_MLP_KINDS: dict[type, MlpKind] = {Moe: _MoeKindOnUse()}


def register_mlp_kind(description: type, kind: MlpKind) -> None:
    """Build and convert MLPs described by instances of ``description`` (e.g. :class:`Moe`) with ``kind``.

    >>> register_mlp_kind(int, object())
    Traceback (most recent call last):
    TypeError: register_mlp_kind(int, ...): pass a frozen dataclass type of MLP description, e.g. Moe
    """
    params = getattr(description, "__dataclass_params__", None)
    if not isinstance(description, type) or params is None or not params.frozen:
        raise TypeError(f"register_mlp_kind({getattr(description, '__name__', description)}, ...): pass a frozen "
                        "dataclass type of MLP description, e.g. Moe")
    _MLP_KINDS[description] = kind


def mlp_kind(description) -> MlpKind:
    """The :class:`MlpKind` registered for ``type(description)``; NotImplementedError when there is none."""
    try:
        return _MLP_KINDS[type(description)]
    except KeyError:
        raise NotImplementedError(
            f"packfwd builds no {type(description).__name__} MLP yet: no MLP kind is registered for it "
            f"(packfwd.models.families.family.register_mlp_kind; Mixture-of-Experts layers come with packfwd.models.mlp.moe). "
            "Build the model with dense MLPs (moe=None) meanwhile"
        ) from None
