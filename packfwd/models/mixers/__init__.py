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
* Gated DeltaNet (issue 30; not yet a component): :mod:`~packfwd.models.mixers.deltanet`, exact over packed sequences.

Importing this package does not import Megatron-Core.
"""

from .latent import MLA as MLA
from .latent import Mla as Mla
from .latent import Yarn as Yarn
from .softmax import SOFTMAX as SOFTMAX

__all__ = ["MLA", "Mla", "SOFTMAX", "Yarn", "mixer"]


def mixer(args, layer: int | None = None):
    """The token-mixer component of global layer ``layer`` (None: the model's) of a model of ``args``
    (a :class:`~packfwd.models.args.ModelArgs`; None: softmax attention): ``MLA`` when ``args.mla`` describes
    multi-head latent attention, else ``SOFTMAX``.

    >>> mixer(None).name
    'softmax attention'
    """
    return MLA if getattr(args, "mla", None) is not None else SOFTMAX
