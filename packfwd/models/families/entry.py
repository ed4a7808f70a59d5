"""What a model family is: one :class:`Family` entry, written in its own module of :mod:`packfwd.models.families`.

An entry names the transformers ``model_type`` s it converts, its layer components (the token mixer: softmax
attention or multi-head latent attention; the MLP: dense, or a Mixture of Experts when ``read_moe`` finds one), how
to read their fields from a config (``read_attention``, ``read_moe``: the family's own config flags, e.g. Qwen2's
bias on q, k and v, GLM-4.5's ``use_qk_norm``), what it refuses, and the rows of the decoder layer's own weights
(its norms).  :meth:`Family.hf_fields` reads one model's :class:`~packfwd.models.args.ModelArgs` fields;
everything else is derived from the model's arguments through the components: the Megatron-Core config
(:func:`packfwd.models.runtime.config.transformer_config`), the layer spec (:mod:`packfwd.models.runtime.spec`) and
the weight mapping, this entry's ``layer_weights`` with each layer's components' tables
(:mod:`packfwd.models.convert.hf_weights`).  No Megatron-Core here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from ..component import Component
from ..mapping import Weight
from ..mixers import SOFTMAX, mixer
from ..mixers.softmax import hf_attention_fields
from ..mlp import mlp

__all__ = ["FULL_CAUSAL", "Family", "LAYER_NORMS", "QWEN3_ATTENTION_BIAS"]

# The decoder layer's own weights (Llama's layout, every family's so far): Megatron-Core <- HF, per layer.
LAYER_NORMS = (
    Weight("input_layernorm.weight", "input_layernorm.weight"),
    Weight("pre_mlp_layernorm.weight", "post_attention_layernorm.weight"),
)

# Refusals shared by several families: (HF flag, why and what to do), refused when the flag is set.
FULL_CAUSAL = ("use_sliding_window", "packfwd's attention is full causal; set it to False")
QWEN3_ATTENTION_BIAS = (
    "attention_bias", "Qwen3's attention_bias puts a bias on q, k, v and o but none on the MLP; Megatron-Core "
    "biases all linears or none (add_bias_linear), so packfwd builds Qwen3 with attention_bias=False")


def _families():
    from . import FAMILIES  # the registry imports every family module, this one first

    return FAMILIES.values()


@dataclass(frozen=True)
class Family:
    """What every model of one transformers family shares, and how to read a model's numbers from its config
    (module docstring).

    >>> from packfwd.models.families import FAMILIES
    >>> FAMILIES["deepseek_v3"].attention.name, FAMILIES["llama"].linear_bias_flags
    ('multi-head latent attention', ('attention_bias', 'mlp_bias'))
    """

    name: str  # the key in FAMILIES, and ModelArgs.family
    hf_model_types: tuple[str, ...]  # the transformers config model_type(s) it converts
    attention: Component = SOFTMAX  # the token mixer of its layers (packfwd.models.mixers)
    read_attention: Callable[[Any], dict] = hf_attention_fields  # the mixer's ModelArgs fields of a config
    read_moe: Callable[[Any], Any] | None = None  # the Moe of a config (None from it: dense); None: dense always
    norm: str = "rmsnorm"  # every norm (packfwd builds RMSNorm only)
    linear_bias_flags: tuple[str, ...] = ()  # HF flags putting a bias on every linear (must be equal: Megatron's
    #                                          add_bias_linear is one switch)
    unsupported: tuple[tuple[str, str], ...] = ()  # (HF flag, why and what to do): refused when the flag is set
    rope_scalings: tuple[str, ...] = ("default", "llama3")  # HF rope_type values it converts
    tie_embeddings: bool = False  # when the config does not say (tie_word_embeddings)
    mrope: bool = False  # multimodal RoPE (Qwen2-VL): rope_parameters["mrope_section"]; the text under text_config
    layer_weights: tuple[Weight, ...] = LAYER_NORMS  # the decoder layer's own weights (its components' aside)
    linear_attention: Component | None = None  # a hybrid's linear-attention mixer, on ModelArgs.linear_attention's
    #                                            layers (read by read_attention); None: no such layers
    mtp_weights: tuple[Weight, ...] = ()  # an MTP layer's own weights (Megatron-Core names under mtp.layers.0., HF
    #                                       under mtp.; its inner layer is a decoder layer's table); (): not converted
    mtp_depths_unnamed: int = 0  # the MTP depths of a checkpoint whose config has no mtp_num_hidden_layers

    def __post_init__(self):
        if self.norm != "rmsnorm":
            raise ValueError(f"Family {self.name!r}: norm={self.norm!r}; packfwd builds 'rmsnorm' only")

    def components(self, args, layer: int) -> tuple[Component, Component]:
        """The (token mixer, MLP) components of global layer ``layer`` of a model of ``args``."""
        return mixer(args, layer), mlp(args, layer)

    def mtp_depths(self, cfg) -> int:
        """The MTP depths a checkpoint of config ``cfg`` carries (``mtp_num_hidden_layers``; where the config has
        no such field, ``mtp_depths_unnamed``: Qwen3-Next's released configs name none and its checkpoints hold
        one), checked by :meth:`check_mtp`.

        >>> from transformers import Qwen3_5TextConfig
        >>> from packfwd.models.families import FAMILIES
        >>> FAMILIES["qwen3_5"].mtp_depths(Qwen3_5TextConfig(mtp_num_hidden_layers=1))
        1
        """
        text = getattr(cfg, "text_config", None) or cfg
        named = getattr(text, "mtp_num_hidden_layers", None)
        depths = self.mtp_depths_unnamed if named is None else int(named)
        self.check_mtp(depths, f"mtp_num_hidden_layers={depths}")
        if getattr(text, "mtp_use_dedicated_embeddings", False):
            raise ValueError("mtp_use_dedicated_embeddings=True: packfwd's MTP layer embeds with the model's own "
                             "embedding (Megatron-Core's); convert a checkpoint whose config sets it False")
        return depths

    def check_mtp(self, depths: int, source: str) -> None:
        """ValueError, naming the fix, unless this family converts MTP layers of ``depths`` depths (``source``:
        where the number comes from): it needs an MTP mapping (``mtp_weights``) and one depth, since a checkpoint's
        MTP layers share one ``mtp.fc`` and its norms while each of Megatron-Core's depths has its own."""
        if not self.mtp_weights:
            with_mtp = ", ".join(sorted(f.name for f in _families() if f.mtp_weights))
            raise ValueError(f"{source}: packfwd has no MTP weight mapping for family {self.name!r} (it converts "
                             f"those of {with_mtp}); leave mtp_state_dict out of from_hf, or convert the model "
                             "without its MTP layers (megatron_to_hf with dataclasses.replace(args, mtp_num_layers=0))")
        if depths > 1:
            raise ValueError(f"{source}: the checkpoint's MTP layers share one mtp.fc and its norms, while each of "
                             "Megatron-Core's MTP depths has its own; packfwd converts one MTP depth "
                             "(mtp_num_hidden_layers=1, every released checkpoint's)")

    def hf_fields(self, cfg) -> dict:
        """The :class:`~packfwd.models.args.ModelArgs` fields of the transformers config ``cfg`` (all but the
        value head's); ValueError, naming the config's flag, for what packfwd cannot build.

        >>> from transformers import LlamaConfig
        >>> from packfwd.models.families import FAMILIES
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
        return dict(
            family=self.name,
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            # a model whose every MLP is MoE has no dense width (Qwen3.5-MoE's config): the experts' stands in
            ffn_hidden_size=getattr(cfg, "intermediate_size", None) or cfg.moe_intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_attention_heads=cfg.num_attention_heads,
            norm_eps=cfg.rms_norm_eps,
            rope_theta=theta,
            rope_scaling_factor=factor,
            linear_bias=self._linear_bias(cfg),
            max_position_embeddings=cfg.max_position_embeddings,
            moe=self.read_moe(cfg) if self.read_moe is not None else None,
            **self.read_attention(cfg),
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
        """(theta, Llama-3 scaling factor or None) of the config's RoPE (YaRN: read by the mixer's reader)."""
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        kind = params.get("rope_type", params.get("type", "default"))
        if kind not in self.rope_scalings:
            raise ValueError(f"rope_type={kind!r} is not supported; packfwd converts "
                             f"{' and '.join(repr(k) for k in self.rope_scalings)} RoPE for {self.name}")
        if kind in ("default", "mrope", "yarn"):  # "mrope": multimodal RoPE without frequency scaling (Qwen2-VL)
            return theta, None
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(float(params.get(k, v)) != v for k, v in expected.items()):
            raise ValueError(f"llama3 RoPE scaling {params}: Megatron-Core supports low_freq_factor=1, "
                             "high_freq_factor=4, original_max_position_embeddings=8192 only")
        return theta, float(params["factor"])

    @staticmethod
    def _mrope_section(cfg) -> tuple[int, ...]:
        params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        if params.get("mrope_section") is None:
            raise ValueError("the config has no rope_parameters['mrope_section']; a Qwen2-VL language model needs one")
        return tuple(params["mrope_section"])
