"""The MLPs of a decoder layer, one component each (:class:`~packfwd.models.component.Component`: its
``ModelArgs`` fields, Megatron-Core config fields, layer spec and weight table); :func:`mlp` says which one a layer
has, :func:`mlp_kind` which component builds a description type.

* ``DENSE``: the dense SwiGLU MLP (:mod:`~packfwd.models.mlp.dense`);
* ``MOE``: the Mixture of Experts described by ``Moe`` (:mod:`~packfwd.models.mlp.moe`), built from
  :mod:`~packfwd.models.mlp.router` (``PackedRouter``), :mod:`~packfwd.models.mlp.experts` (grouped experts) and
  :mod:`~packfwd.models.mlp.dispatch` (the token dispatchers); :mod:`~packfwd.models.mlp.routing` (routing
  statistics, the load-balancing loss), :mod:`~packfwd.models.mlp.aux_loss` (a model's auxiliary loss) and
  :mod:`~packfwd.models.mlp.moe_weights` (the routed experts' HF weights, expert-parallel shards).

Another MLP is a frozen dataclass describing it (in ``ModelArgs.moe``) and a component registered for its type with
:func:`register_mlp_kind`.  Importing this package does not import Megatron-Core.
"""

from .dense import DENSE as DENSE
from .moe import MOE as MOE
from .moe import Moe as Moe

__all__ = ["DENSE", "MOE", "Moe", "mlp", "mlp_kind", "register_mlp_kind"]

_MLP_KINDS: dict[type, object] = {Moe: MOE}


def register_mlp_kind(description: type, kind) -> None:
    """Build and convert MLPs described by instances of ``description`` (a frozen dataclass type, e.g. ``Moe``) with
    ``kind`` (a :class:`~packfwd.models.component.Component`).

    >>> register_mlp_kind(int, object())
    Traceback (most recent call last):
    TypeError: register_mlp_kind(int, ...): pass a frozen dataclass type of MLP description, e.g. Moe
    """
    params = getattr(description, "__dataclass_params__", None)
    if not isinstance(description, type) or params is None or not params.frozen:
        raise TypeError(f"register_mlp_kind({getattr(description, '__name__', description)}, ...): pass a frozen "
                        "dataclass type of MLP description, e.g. Moe")
    _MLP_KINDS[description] = kind


def mlp_kind(description):
    """The component registered for ``type(description)``; NotImplementedError naming the fix when there is none.

    >>> mlp_kind(Moe(num_experts=2, top_k=1, ffn_hidden_size=4)).name
    'Mixture of Experts'
    """
    try:
        return _MLP_KINDS[type(description)]
    except KeyError:
        raise NotImplementedError(
            f"packfwd builds no {type(description).__name__} MLP yet: no MLP kind is registered for it "
            "(packfwd.models.mlp.register_mlp_kind). Build the model with dense MLPs (moe=None) meanwhile"
        ) from None


def mlp(args, layer: int = 0):
    """The MLP component of global layer ``layer`` of a model of ``args`` (None: dense): ``DENSE`` where
    ``args.dense_mlp(layer)``, else the kind of ``args.moe``.

    >>> mlp(None).name
    'dense SwiGLU MLP'
    """
    return DENSE if args is None or args.dense_mlp(layer) else mlp_kind(args.moe)
