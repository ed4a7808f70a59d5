"""Which transformer layers each pipeline stage builds, exactly as Megatron-Core places them.

Megatron-Core splits ``num_layers`` decoder layers over ``pp`` pipeline ranks and, with
interleaving, ``vpp`` virtual stages (model chunks) per rank. The placement it uses is given by
``get_transformer_layer_offset`` (``megatron/core/transformer/transformer_layer.py``) and
``get_num_layers_to_build`` (``megatron/core/transformer/transformer_block.py``); the sizes it
accepts are checked by ``TransformerConfig.__post_init__`` and by those two functions. This module
states the same placement as plain Python, so a trainer can map global layer indices (checkpoint
names, per-layer statistics, router replay buffers) to ``(pp_rank, vpp_rank, local_index)`` without
building a model or touching process groups.

The rules, with ``n = num_layers``:

* Even split (no ``first_stage_layers``/``last_stage_layers``): every pp rank holds ``n // pp``
  layers, which must be a whole number and divisible by ``vpp``.
* Uneven split: the first (last) pp rank holds ``first_stage_layers`` (``last_stage_layers``); the
  layers left over are spread evenly over the remaining "middle" ranks.
* Every pp rank cuts its layers into ``vpp`` equal chunks. Chunks are laid out round-robin: virtual
  stage 0 of ranks 0..pp-1 holds the first layers, then virtual stage 1 of ranks 0..pp-1, and so
  on.

Megatron-Core's checks never leave a stage empty, and neither do these: every range is non-empty.

Not covered: ``pipeline_model_parallel_layout`` and ``account_for_embedding_in_pipeline_split`` /
``account_for_loss_in_pipeline_split`` (placement with embedding/loss stages).

Two places where packfwd is stricter than Megatron-Core, because Megatron accepts a configuration
and then builds a wrong model or a contradictory one:

* The middle ranks must get at least one layer each; Megatron's config check only asks for a
  non-zero remainder, so ``first_stage_layers + last_stage_layers > num_layers`` can slip through
  and produce a negative layer count.
* With ``pp == 1`` the single rank is both first and last, so ``first_stage_layers`` and
  ``last_stage_layers`` (when given) must equal ``num_layers``; Megatron silently ignores a
  first-stage size that contradicts the last-stage one.

And one Megatron-Core limitation mirrored as an error: with ``pp == 2``, ``vpp > 1`` and both
``first_stage_layers`` and ``last_stage_layers`` set, Megatron's offset computation divides by the
(zero) number of middle stages and fails; giving only ``first_stage_layers`` yields the same
placement.

Pure Python: importing this module imports neither torch nor Megatron-Core.
"""

from __future__ import annotations

import math
import operator
from typing import NamedTuple, Optional

__all__ = ["LayerOwner", "layer_owner", "layer_partition"]


class LayerOwner(NamedTuple):
    """Where one global layer lives: ``layer_partition(...)[pp_rank][vpp_rank][local_index]``."""

    pp_rank: int
    """Pipeline-parallel rank that builds the layer."""
    vpp_rank: int
    """Virtual pipeline stage (model chunk) on that rank; 0 without interleaving."""
    local_index: int
    """Index of the layer inside that chunk's ``TransformerBlock.layers``."""


def _as_int(name: str, value, minimum: int) -> int:
    """``value`` as a plain int >= ``minimum``; TypeError/ValueError naming ``name`` otherwise."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool {value!r}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__} {value!r}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _single_stage_counts(num_layers: int, first: Optional[int], last: Optional[int]) -> list[int]:
    """pp == 1: the only stage is both first and last, so a given size must be all layers."""
    for name, given in (("first_stage_layers", first), ("last_stage_layers", last)):
        if given is not None and given != num_layers:
            raise ValueError(
                f"{name}={given} but num_layers={num_layers}: with pp=1 the only stage is both "
                f"first and last, so pass {name}=None or {name}={num_layers}"
            )
    return [num_layers]


def _even_counts(num_layers: int, pp: int, vpp: int) -> list[int]:
    """No uneven stage: every pp rank holds num_layers // pp layers."""
    if num_layers % pp:
        raise ValueError(
            f"num_layers={num_layers} is not divisible by pp={pp}; choose num_layers and pp with "
            f"num_layers % pp == 0, or set first_stage_layers/last_stage_layers for an uneven split"
        )
    per_rank = num_layers // pp
    if per_rank % vpp:
        raise ValueError(
            f"num_layers // pp = {per_rank} layers per pipeline rank must be divisible by "
            f"vpp={vpp}; pick vpp from {_divisors(per_rank)} or change num_layers"
        )
    return [per_rank] * pp


def _uneven_counts(
    num_layers: int, pp: int, vpp: int, first: Optional[int], last: Optional[int]
) -> list[int]:
    """pp >= 2 with first and/or last stage sizes given; the rest spread over the middle ranks."""
    num_middle = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    # the vpp values every stage's share divides by; none to offer while the middle ranks' share is not whole
    # (that error comes below), and only vpp=1 with pp=2 and both ends set (Megatron-Core's limit, below)
    if num_middle == 0:
        choices = [1] if middle_layers == 0 else None
    elif middle_layers >= num_middle and middle_layers % num_middle == 0:
        choices = _divisors(math.gcd(*(size for size in (first, last, middle_layers // num_middle) if size)))
    else:
        choices = None
    for name, given in (("first_stage_layers", first), ("last_stage_layers", last)):
        if given is not None and given % vpp:
            raise ValueError(
                f"{name}={given} must be divisible by vpp={vpp}; pick a multiple of {vpp}"
                + (f" or vpp from {choices}" if choices else "")
            )
    if num_middle == 0:
        if middle_layers != 0:
            raise ValueError(
                f"with pp={pp} there are no middle stages, so first_stage_layers + "
                f"last_stage_layers (= {num_layers - middle_layers}) must equal "
                f"num_layers={num_layers}"
            )
        if vpp > 1:
            # Megatron-Core's layer offset divides by the number of middle stages here and fails.
            raise ValueError(
                f"Megatron-Core cannot place pp=2, vpp={vpp} with both first_stage_layers and "
                f"last_stage_layers set; pass only first_stage_layers={first} (the last rank then "
                f"gets the other {last} layers, the same placement) or use vpp=1"
            )
        return [first, last]
    per_middle, rest = divmod(middle_layers, num_middle)
    if middle_layers < num_middle or rest:
        raise ValueError(
            f"num_layers - first_stage_layers - last_stage_layers = {middle_layers} layers must "
            f"be a positive multiple of the {num_middle} middle pipeline stages (pp={pp}); "
            f"change num_layers, first_stage_layers or last_stage_layers"
        )
    if per_middle % vpp:
        raise ValueError(
            f"each middle pipeline stage gets {per_middle} layers, not divisible by vpp={vpp}; "
            f"pick vpp from {choices} or change first_stage_layers/last_stage_layers"
        )
    counts = [per_middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def layer_partition(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    *,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> list[list[range]]:
    """Global layer indices (0-based) built on every pipeline rank and virtual stage.

    Args:
        num_layers: decoder layers in the model (``TransformerConfig.num_layers``), >= 1.
        pp: pipeline-parallel size (``pipeline_model_parallel_size``), >= 1.
        vpp: virtual stages per pp rank (``virtual_pipeline_model_parallel_size``; 1 = no
            interleaving, which Megatron-Core writes as ``None``). vpp > 1 needs pp >= 2.
        first_stage_layers: ``num_layers_in_first_pipeline_stage``; None for an even split.
        last_stage_layers: ``num_layers_in_last_pipeline_stage``; None for an even split.

    Returns:
        ``p`` with ``len(p) == pp`` and ``len(p[r]) == vpp``; ``p[r][v]`` is the non-empty ``range``
        of global layers built by virtual stage ``v`` of pp rank ``r``, in the order of that chunk's
        ``TransformerBlock.layers``. Every layer appears in exactly one range.

    Raises:
        TypeError: an argument is not an int.
        ValueError: a configuration Megatron-Core refuses (or would build wrongly, see the module
            docstring); the message names the argument and what to change.

    Example: 32 layers, 4 pipeline ranks, 2 virtual stages each. Every rank holds 8 layers in two
    chunks of 4; virtual stage 0 of all ranks comes first, then virtual stage 1.

    >>> p = layer_partition(32, pp=4, vpp=2)
    >>> for rank, chunks in enumerate(p):
    ...     print(rank, chunks)
    0 [range(0, 4), range(16, 20)]
    1 [range(4, 8), range(20, 24)]
    2 [range(8, 12), range(24, 28)]
    3 [range(12, 16), range(28, 32)]

    Uneven split: 30 layers, 6 on the first and last rank, 18 spread over the 2 middle ranks.

    >>> layer_partition(30, 4, first_stage_layers=6, last_stage_layers=6)
    [[range(0, 6)], [range(6, 15)], [range(15, 24)], [range(24, 30)]]
    """
    num_layers = _as_int("num_layers", num_layers, 1)
    pp = _as_int("pp", pp, 1)
    vpp = _as_int("vpp", vpp, 1)
    if first_stage_layers is not None:
        first_stage_layers = _as_int("first_stage_layers", first_stage_layers, 1)
    if last_stage_layers is not None:
        last_stage_layers = _as_int("last_stage_layers", last_stage_layers, 1)
    if vpp > 1 and pp == 1:
        raise ValueError(
            f"vpp={vpp} needs pp >= 2: Megatron-Core only interleaves virtual stages across "
            f"pipeline ranks; pass vpp=1 or pp >= 2"
        )
    if pp == 1:
        counts = _single_stage_counts(num_layers, first_stage_layers, last_stage_layers)
    elif first_stage_layers is None and last_stage_layers is None:
        counts = _even_counts(num_layers, pp, vpp)
    else:
        counts = _uneven_counts(num_layers, pp, vpp, first_stage_layers, last_stage_layers)
    partition: list[list[range]] = [[] for _ in range(pp)]
    start = 0
    for _ in range(vpp):  # round-robin: virtual stage v of every rank before virtual stage v + 1
        for rank in range(pp):
            size = counts[rank] // vpp
            partition[rank].append(range(start, start + size))
            start += size
    return partition


def layer_owner(
    layer: int,
    num_layers: int,
    pp: int,
    vpp: int = 1,
    *,
    first_stage_layers: Optional[int] = None,
    last_stage_layers: Optional[int] = None,
) -> LayerOwner:
    """The pp rank, virtual stage and local index that build global layer ``layer`` (0-based).

    Takes the same configuration as :func:`layer_partition` (and raises the same errors for it);
    ``ValueError`` if ``layer`` is not in ``[0, num_layers)``.

    >>> layer_owner(21, 32, pp=4, vpp=2)
    LayerOwner(pp_rank=1, vpp_rank=1, local_index=1)
    >>> layer_partition(32, pp=4, vpp=2)[1][1][1]
    21
    """
    partition = layer_partition(
        num_layers,
        pp,
        vpp,
        first_stage_layers=first_stage_layers,
        last_stage_layers=last_stage_layers,
    )
    layer = _as_int("layer", layer, 0)
    if layer >= num_layers:
        raise ValueError(f"layer={layer} is out of range: the model has num_layers={num_layers}")
    for pp_rank, chunks in enumerate(partition):
        for vpp_rank, chunk in enumerate(chunks):
            if layer in chunk:
                return LayerOwner(pp_rank, vpp_rank, layer - chunk.start)
    raise AssertionError("unreachable: layer_partition covers every layer")  # pragma: no cover
