"""mbridge (verl's HF <-> Megatron-Core bridge) on a model packfwd builds.

verl loads a HF checkpoint into its Megatron-Core actor, and exports the actor's weights to the rollout engine,
through mbridge (``use_mbridge=True``).  mbridge knows the parameter names of Transformer Engine layers; packfwd
builds Megatron-Core's non-TE layers, whose names differ in two places: the norms are ``input_layernorm`` /
``pre_mlp_layernorm`` (TE fuses them into ``linear_qkv.layer_norm_weight`` / ``linear_fc1.layer_norm_weight``) and
the experts are ``SequentialMLP``'s ``local_experts.{e}.linear_fc1.weight`` (TEGroupedMLP's ``linear_fc1.weight{e}``).
:func:`packfwd_bridge` is mbridge's bridge of the model type with those names translated::

    import torch
    from packfwd.verl import packfwd_bridge

    # model: packfwd's model of hf_config (packfwd.models.from_hf, or build_model(..., init=False)), bfloat16
    bridge = packfwd_bridge(hf_config, torch.bfloat16)   # the model's parameter dtype
    bridge.load_weights([model], checkpoint_dir)         # the HF safetensors into the model's parameters
    hf_weights = dict(bridge.export_weights([model]))    # and back, by HF name (e.g. for the rollout engine)

Under tensor parallelism call both on every rank of the TP group: mbridge reads on TP rank 0 and scatters, and
the export all-gathers.  ``tests/test_bridge.py`` follows this for every family both convert (a load equals
``from_hf``'s parameters bit for bit, an export gives the checkpoint back) and pins where mbridge 0.15.1 is missing
or wrong (value heads, Llama's ``mlp_bias``, Qwen3-MoE's dense layers, a tied Llama's last pipeline stage):
docs/models.md, "Conversion, hand-written or a bridge".

Importing this module imports neither mbridge nor Megatron-Core: :func:`packfwd_bridge` imports mbridge when
called (``pip install --no-deps "mbridge==0.15.1" "einops>=0.6"``, as the Makefile does).
"""

from __future__ import annotations

import copy
import re

import torch

__all__ = ["mbridge_name", "packfwd_bridge"]

_EXPERT = re.compile(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight")


def mbridge_name(name: str) -> str:
    """packfwd's Megatron-Core parameter name -> the Transformer Engine / TEGroupedMLP name mbridge maps.

    >>> mbridge_name("decoder.layers.0.input_layernorm.weight")
    'decoder.layers.0.self_attention.linear_qkv.layer_norm_weight'
    >>> mbridge_name("decoder.layers.1.mlp.experts.local_experts.3.linear_fc1.weight")
    'decoder.layers.1.mlp.experts.linear_fc1.weight3'
    >>> mbridge_name("decoder.layers.0.self_attention.linear_qkv.weight")   # the same in both
    'decoder.layers.0.self_attention.linear_qkv.weight'
    """
    name = name.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
    return _EXPERT.sub(r".mlp.experts.\2.weight\1", name)


class _PackfwdNames:
    """Mixed in before an mbridge model bridge: it sees packfwd's parameter names as the ones it knows."""

    def _adjust_mapping_for_shared_weights(self):
        # mbridge's Qwen2 bridge writes the tied output layer into the class's dict (Qwen3's bridge shares it), so
        # a later untied bridge in the process would load the embedding as the output layer: use a copy
        self._DIRECT_MAPPING = {**type(self)._DIRECT_MAPPING, "output_layer.weight": "lm_head.weight"}
        super()._adjust_mapping_for_shared_weights()

    def _weight_name_mapping_mcore_to_hf(self, name):
        name = mbridge_name(name)
        if not self.config.num_moe_experts:  # a dense model's MLP norm is TE-fused into linear_fc1
            name = name.replace(".pre_mlp_layernorm.weight", ".mlp.linear_fc1.layer_norm_weight")
        return super()._weight_name_mapping_mcore_to_hf(name)

    def _weight_to_hf_format(self, name, weight):
        return super()._weight_to_hf_format(mbridge_name(name), weight)

    def _weight_to_mcore_format(self, name, weights):
        return super()._weight_to_mcore_format(mbridge_name(name), weights)


def packfwd_bridge(hf_config, dtype: torch.dtype, **kwargs):
    """mbridge's bridge of ``hf_config``'s model type, reading and writing the parameter names of packfwd's model.

    ``dtype``: the model's parameter dtype (mbridge casts every HF weight to it on load; its own default, bfloat16,
    would round a float32 model's weights).  ``kwargs`` go to mbridge's bridge (``parallel_states``,
    ``make_vocab_size_divisible_by``).  A ``hf_config`` whose ``head_dim`` is None (transformers 5's Mixtral) is
    given ``hidden_size // num_attention_heads`` on a copy: mbridge multiplies it.  See the module docstring for
    the use; mbridge's own model, config and layer spec are not used (packfwd builds the model).
    """
    try:
        from mbridge.core.bridge import _MODEL_REGISTRY
    except ImportError as error:  # mbridge itself, or einops (it imports it)
        raise ImportError(f"packfwd_bridge needs mbridge ({error}); install it with "
                          '`pip install --no-deps "mbridge==0.15.1" "einops>=0.6"`') from error
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be the model's torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    cls = _MODEL_REGISTRY.get(hf_config.model_type)
    if cls is None:
        raise ValueError(f"mbridge has no bridge for model_type={hf_config.model_type!r}; it has "
                         f"{sorted(_MODEL_REGISTRY)}")
    if getattr(hf_config, "head_dim", None) is None:
        hf_config = copy.copy(hf_config)
        hf_config.head_dim = hf_config.hidden_size // hf_config.num_attention_heads
    return type(f"Packfwd{cls.__name__}", (_PackfwdNames, cls), {})(hf_config, dtype=dtype, **kwargs)
