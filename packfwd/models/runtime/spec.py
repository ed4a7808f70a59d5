"""The layer spec of packfwd's models, assembled from their :class:`~packfwd.models.args.ModelArgs`: Megatron-Core's
own ``TransformerLayer`` around the layer's components, each asked for its part's spec (no branch on their kinds
here): the token mixer (:func:`packfwd.models.mixers.mixer`: softmax attention, or multi-head latent attention) and
the MLP (:func:`packfwd.models.mlp.mlp`: dense SwiGLU, or a Mixture of Experts).

Per layer (names as in the state dict)::

    input_layernorm        RMSNorm
    self_attention         the mixer's spec (:mod:`packfwd.models.mixers.softmax`, :mod:`packfwd.models.mixers.mla`),
                           its core attention packfwd's CoreAttention with the backend and the model's THD RoPE
    pre_mlp_layernorm      RMSNorm
    mlp                    the MLP's spec (:mod:`packfwd.models.mlp.dense`, :mod:`packfwd.models.mlp.moe`)

The norms are :mod:`packfwd.models.norm`'s (fused or not: ``args.fused``).  Megatron-Core is imported inside the
functions only.
"""

from __future__ import annotations

from ..mixers import mixer
from ..mlp import mlp
from ..norm import norm_class

__all__ = ["block_spec", "layer_spec", "mlp_spec"]


def layer_spec(args=None, layer: int = 0, *, attention_backend: str | None = None, rope=None):
    """The ``ModuleSpec`` of global decoder layer ``layer`` (0-based) of a model of ``args`` (see the module
    docstring; None: a Llama layer, no QK-norm and a dense MLP).

    ``attention_backend`` and ``rope`` are the params of :class:`~packfwd.models.mixers.attention.CoreAttention`:
    its varlen backend (None: automatic) and the RoPE it applies to THD batches (a
    :class:`~packfwd.models.mixers.rope.PackedRope` shared by all layers, or the mixer's own; None: q and k arrive
    rotated).

    >>> spec = layer_spec(attention_backend="reference")
    >>> core = spec.submodules.self_attention.submodules.core_attention
    >>> core.module.__name__, core.params
    ('CoreAttention', {'backend': 'reference', 'rope': None})
    """
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_layer import TransformerLayer, TransformerLayerSubmodules

    attention = mixer(args, layer).layer_spec(args, layer, attention_backend=attention_backend, rope=rope,
                                              qk_norm=norm_class(args, "qk"))
    return ModuleSpec(
        module=TransformerLayer,
        submodules=TransformerLayerSubmodules(
            input_layernorm=norm_class(args),
            self_attention=attention,
            self_attn_bda=get_bias_dropout_add,
            pre_mlp_layernorm=norm_class(args),
            mlp=mlp_spec(args, layer),
            mlp_bda=get_bias_dropout_add,
        ),
    )


def mlp_spec(args=None, layer: int = 0):
    """The ``ModuleSpec`` of global layer ``layer``'s MLP: its component's (:func:`packfwd.models.mlp.mlp`; dense
    SwiGLU where ``args`` is None).

    >>> mlp_spec().submodules.linear_fc1.__name__, mlp_spec().submodules.activation_func.__name__
    ('ColumnParallelLinear', 'SwiGLU')
    """
    return mlp(args, layer).layer_spec(args, layer)


def block_spec(layers, *, args=None, attention_backend: str | None = None, rope=None):
    """``TransformerBlockSubmodules`` with the global layers ``layers`` (0-based; an int ``n``: ``range(n)``) of a
    model of ``args`` (:func:`layer_spec`), and the final RMSNorm.

    Giving the block its layers explicitly (instead of one layer spec that Megatron-Core repeats) fixes the
    final norm to :class:`~packfwd.models.norm.RMSNorm` whatever extensions are installed, lets each layer be built from its own
    spec (a dense layer among Mixture-of-Experts ones), and lets the pipeline-stage builder state the layer
    count it expects from ``packfwd.layers.layer_partition``.

    >>> block = block_spec(3)
    >>> len(block.layer_specs), block.layer_norm.__name__
    (3, 'RMSNorm')
    """
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

    layers = range(layers) if isinstance(layers, int) else layers
    specs = [layer_spec(args, i, attention_backend=attention_backend, rope=rope) for i in layers]
    return TransformerBlockSubmodules(layer_specs=specs, layer_norm=norm_class(args))
