"""Agreeing on bad input across ranks, so that every rank raises the same error instead of some of them hanging.

A rank that rejects its input while the others go on into a collective leaves them waiting for it.
:func:`check_across_ranks` is the one collective every rank reaches after validating its inputs, whatever the
result: each rank contributes its own error (or None) and a few integers that must be equal everywhere (a
fingerprint of the batch: sizes, token counts); if any rank failed or the fingerprints differ, every rank raises
the same exception with the same message.  On the happy path it costs one all-gather of a few integers (and one
read of the result on the host).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

__all__ = ["check_across_ranks"]

_SLOTS = 16  # status, count, up to 14 integers of fingerprint


def check_across_ranks(
    group: Any,
    *,
    error: BaseException | None = None,
    values: Sequence[int] = (),
    what: str = "inputs",
) -> None:
    """Collective over ``group`` (None: the default group): raise the same exception on every rank if any rank
    passes an ``error`` or the ``values`` differ between ranks.

    ``error``: what validating this rank's inputs raised, or None.  The exception raised everywhere has the type of
    the failing rank's error when it is a ``ValueError`` or ``TypeError`` (else ``RuntimeError``) and the message
    ``"rank r of n in the process group rejected its inputs: <its message>"`` (r the lowest failing rank).
    ``values``: up to 14 Python ints that every rank must agree on (``what`` names them in the error).  Every
    rank of ``group`` must call this.

    >>> from packfwd.testing import run_local
    >>> from packfwd.parallel.agree import _example_agree
    >>> seen = run_local(_example_agree, 2, backend="gloo")   # rank 1 rejects its input
    >>> seen[0] == seen[1], seen[0]                           # both ranks raise its error
    (True, 'ValueError: rank 1 of 2 in the process group rejected its inputs: bad mask on rank 1')
    """
    import torch.distributed as dist

    values = [int(v) for v in values]
    if len(values) > _SLOTS - 2:
        raise ValueError(f"values holds {len(values)} integers; pass at most {_SLOTS - 2}")
    world = dist.get_world_size(group)
    if world == 1:
        if error is not None:
            raise error
        return
    row = torch.zeros(_SLOTS, dtype=torch.int64)
    row[0], row[1] = int(error is not None), len(values)
    row[2 : 2 + len(values)] = torch.tensor(values, dtype=torch.int64)
    device = _group_device(group)
    rows = [torch.empty_like(row, device=device) for _ in range(world)]
    dist.all_gather(rows, row.to(device), group=group)
    table = torch.stack(rows).cpu()  # [world, slots]
    failed = table[:, 0].nonzero().view(-1).tolist()
    if failed:
        reports: list = [None] * world
        mine = None if error is None else (type(error).__name__, str(error))
        dist.all_gather_object(reports, mine, group=group)
        rank = failed[0]
        kind, message = reports[rank]
        text = f"rank {rank} of {world} in the process group rejected its inputs: {message}"
        if len(failed) > 1:
            text += f" (ranks {failed} rejected theirs)"
        raise {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)(text) from error
    differs = [r for r in range(world) if not torch.equal(table[r], table[0])]
    if differs:
        r = differs[0]
        raise ValueError(
            f"the ranks of the process group got different {what}: rank 0 has {_shown(table[0])}, rank {r} has "
            f"{_shown(table[r])}; every rank of the group must get the same {what}"
        )


def _shown(row: torch.Tensor) -> list[int]:
    return row[2 : 2 + int(row[1])].tolist()


def _group_device(group: Any) -> torch.device:
    """Where the group's collectives take tensors: the current CUDA device for NCCL, else the CPU."""
    import torch.distributed as dist

    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _example_agree(rank: int, world_size: int) -> str:
    """Doctest helper for :func:`check_across_ranks` (module level, so that ``run_local`` can spawn it)."""
    error = ValueError("bad mask on rank 1") if rank == 1 else None
    try:
        check_across_ranks(None, error=error, values=[4, 12])
    except ValueError as exc:
        return f"ValueError: {exc}"
    return "ok"
