"""Megatron-Core's ``TransformerConfig`` of a model (:func:`transformer_config`): the model's own fields, and each
layer component's (:mod:`packfwd.models.component`: the token mixer's, the MLPs'), in the config class the token
mixer names.  Megatron-Core is imported inside the function only.
"""

from __future__ import annotations

import torch

from ..args import ModelArgs
from ..families import family
from ..mixers import mixer, mixers
from ..mlp import DENSE, mlp_kind

__all__ = ["transformer_config"]


def transformer_config(
    args: ModelArgs,
    *,
    params_dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    tp_size: int = 1,
    cp_size: int = 1,
    sequence_parallel: bool = False,
    pp_size: int = 1,
    vpp_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
    init: bool = True,
):
    """Megatron-Core's ``TransformerConfig`` for ``args`` (its class and fields: the model's own here, each layer
    component's from the component, :mod:`packfwd.models.component`): no dropout, none of Megatron-Core's fused
    kernels (its unfused paths run on every device and match HF transformers' math), parameters placed for ``device``
    (:func:`packfwd.models.runtime.cpu.config_overrides`).  ``init=False`` skips weight initialisation (for loading).

    ``args.fused`` sets ``use_te_activation_func``: Megatron-Core's MLPs then call the activation module of their
    spec (:class:`packfwd.ops.swiglu.SwiGLU`, which packfwd's specs always name; Megatron-Core ignores it without
    the flag) instead of their own unfused ``glu``.

    >>> args = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
    ...                  num_query_groups=2)
    >>> config = transformer_config(args)
    >>> config.num_query_groups, config.kv_channels, config.normalization, config.gated_linear_unit
    (2, 16, 'RMSNorm', True)
    """
    import torch.nn.functional as F
    from megatron.core.transformer import transformer_config as configs

    from .cpu import config_overrides

    attention = mixer(args)
    mlps = [DENSE] + ([mlp_kind(args.moe)] if args.moe is not None else [])
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=args.hidden_size,
        num_attention_heads=args.num_attention_heads,
        normalization={"rmsnorm": "RMSNorm"}[family(args.family).norm],
        layernorm_epsilon=args.norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        use_te_activation_func=args.fused,  # the spec's activation module (packfwd.ops.swiglu.SwiGLU), see above
        add_bias_linear=args.linear_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_dropout_fusion=False,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        gradient_accumulation_fusion=False,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        tensor_model_parallel_size=tp_size,
        context_parallel_size=cp_size,
        sequence_parallel=sequence_parallel,
        pipeline_model_parallel_size=pp_size,
        virtual_pipeline_model_parallel_size=vpp_size if vpp_size > 1 else None,
        num_layers_in_first_pipeline_stage=first_stage_layers,
        num_layers_in_last_pipeline_stage=last_stage_layers,
        perform_initialization=init,
        mtp_num_layers=args.mtp_num_layers or None,
        mtp_loss_scaling_factor=args.mtp_loss_scaling_factor,
        layernorm_zero_centered_gamma=args.norm_zero_centered,  # packfwd's norms read it from args (norm.py)
        **config_overrides(device),
    )
    for component in (*mixers(args), *mlps):
        fields.update(component.config_fields(args))
    config = getattr(configs, attention.config_class)(**fields)
    for component in (*mixers(args), *mlps):
        if hasattr(component, "finish_config"):  # an MLP kind registered from outside may not have it
            component.finish_config(config, args)
    return config
