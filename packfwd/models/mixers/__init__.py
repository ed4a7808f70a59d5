"""Token mixers: the part of a decoder layer that mixes information across tokens, one component each
(:class:`~packfwd.models.component.Component`: its ``ModelArgs`` fields, Megatron-Core config fields, layer spec,
rotary modules and weight table).  :func:`mixer` says which one a layer has; nothing else branches on the kind.

* ``SOFTMAX``: softmax attention with grouped queries (:mod:`~packfwd.models.mixers.softmax`), built from
  :mod:`~packfwd.models.mixers.attention` (``CoreAttention``, packfwd's core attention over THD or BSHD batches),
  :mod:`~packfwd.models.mixers.varlen` (its varlen backends), :mod:`~packfwd.models.mixers.rope` and
  :mod:`~packfwd.models.mixers.mrope` (RoPE without host syncs, multimodal RoPE; :mod:`~packfwd.models.mixers.rotary`
  checks their fields);
* ``MLA``: multi-head latent attention (DeepSeek-V3): :mod:`~packfwd.models.mixers.latent` (the ``Mla``
  description with its ``Yarn`` scaling, the component, its weights) and :mod:`~packfwd.models.mixers.mla` (the
  Megatron-Core module and spec).
* ``GATED_ATTENTION``: softmax attention with an output gate (Qwen3-Next, Qwen3.5's full-attention layers;
  :mod:`~packfwd.models.mixers.gated_attention`);
* ``GATED_DELTANET``: Gated DeltaNet linear attention on the layers ``args.linear_attention.layers`` of a hybrid model
  (:mod:`~packfwd.models.mixers.gated_deltanet`: the ``DeltaNet`` description, the component, its weights;
  :mod:`~packfwd.models.mixers.gdn`: the Megatron-Core modules; :mod:`~packfwd.models.mixers.deltanet` and
  :mod:`~packfwd.models.mixers.deltanet_ops`: the math, exact over packed sequences).
* ``KIMI_DELTA_ATTENTION``: Kimi Delta Attention (Kimi-Linear) on the layers ``args.linear_attention.layers`` when
  it is a ``Kda`` (:mod:`~packfwd.models.mixers.kimi_delta`; its module :mod:`~packfwd.models.mixers.kda`; the
  math Gated DeltaNet's with a forget gate per key channel).

Importing this package does not import Megatron-Core.
"""

from .latent import MLA as MLA
from .latent import Mla as Mla
from .latent import Yarn as Yarn
from .gated_attention import GATED_ATTENTION as GATED_ATTENTION
from .gated_deltanet import GATED_DELTANET as GATED_DELTANET
from .gated_deltanet import DeltaNet as DeltaNet
from .kimi_delta import KIMI_DELTA_ATTENTION as KIMI_DELTA_ATTENTION
from .kimi_delta import Kda as Kda
from .softmax import SOFTMAX as SOFTMAX

__all__ = ["DeltaNet", "GATED_ATTENTION", "GATED_DELTANET", "KIMI_DELTA_ATTENTION", "Kda", "MLA", "Mla", "SOFTMAX",
           "Yarn", "mixer", "mixers"]


def mixer(args, layer: int | None = None):
    """The token-mixer component of global layer ``layer`` (None: the model's, the one that owns its RoPE) of a
    model of ``args`` (a :class:`~packfwd.models.args.ModelArgs`; None: softmax attention): ``GATED_DELTANET`` on
    the layers ``args.linear_attention.layers`` (``KIMI_DELTA_ATTENTION`` when it is a ``Kda``); elsewhere ``MLA`` when ``args.mla`` describes multi-head latent
    attention, ``GATED_ATTENTION`` with ``args.attention_output_gate``, else ``SOFTMAX``.

    >>> mixer(None).name
    'softmax attention'
    """
    linear = getattr(args, "linear_attention", None)
    if layer is not None and linear is not None and layer in getattr(linear, "layers", ()):
        return _linear(linear)
    if getattr(args, "mla", None) is not None:
        return MLA
    return GATED_ATTENTION if getattr(args, "attention_output_gate", False) else SOFTMAX


def mixers(args) -> tuple:
    """The distinct token-mixer components of a model of ``args``: the model's (:func:`mixer` of no layer) first,
    then any other its layers have (a hybrid model's Gated DeltaNet, listed whenever ``args.linear_attention`` is
    given, so that it checks it).

    >>> [m.name for m in mixers(None)]
    ['softmax attention']
    """
    layers = range(args.num_layers) if args is not None else ()
    linear = [_linear(args.linear_attention)] if getattr(args, "linear_attention", None) is not None else []
    return tuple(dict.fromkeys([mixer(args), *(mixer(args, i) for i in layers), *linear]))


def _linear(description):
    """The linear-attention component of a ``ModelArgs.linear_attention`` description."""
    return KIMI_DELTA_ATTENTION if isinstance(description, Kda) else GATED_DELTANET
