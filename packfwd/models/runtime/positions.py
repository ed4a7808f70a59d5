"""The RoPE positions a packfwd model runs a THD batch on: the caller's, when they describe the packed tokens.

A THD batch (``packed_seq_params.qkv_format == "thd"``) of ``n`` sequences and ``t`` local packed tokens takes
``position_ids`` in one of three forms (:func:`thd_positions`):

* ``[1, t]`` (``[3, 1, t]`` for multimodal RoPE): the position of every packed token, honoured (what
  ``packfwd.pack_positions`` / ``make_forward`` give the model);
* None: each token's position in its own sequence (zigzag-aware under context parallelism);
* ``[n, s]``, verl's padded default beside its packed batch: each row ``clamp(cumsum(mask) - 1, min=0)`` of its
  row.  Megatron-Core's GPTModel never reads this tensor under THD (its RoPE takes positions from
  ``packed_seq_params``), and verl's ``model_forward_gen`` passes it, so it is accepted when it is that default,
  and then not read: each token's position in its own sequence is the same numbers at every real token.

It is checked without the mask, from ``packed_seq_params`` alone (:func:`check_default_positions`): ``b == n``;
each row starts at 0 and steps by 0 or 1; the row's count of real tokens (its last value + 1; 0 or 1 when that
value is 0) fits that sequence's padded length (``cu_seqlens_q_padded``); and it equals the real length
(``cu_seqlens_q``) where that is shorter than the padded length (packfwd's own ``PackedSeqParams`` carry real
lengths there; verl's carry the padded lengths in both, so for them only the bound applies).  It catches shifted
positions (a row not starting at 0), any jump or decrease (custom positions), a tensor for another batch (another
``b``, or a row longer than its sequence) and, with real lengths, rows in the wrong order.  It cannot catch a row
that repeats a position in the middle (a hole in the mask would), when the real lengths are unknown.  On the CPU
the check raises at once; on CUDA it is ``torch._assert_async`` (no host sync; a failure stops the process).

One ambiguity remains: one sequence whose padded width ``s`` equals ``t``.  Then verl's ``[1, s]`` has the shape of
packed positions.  Read as packed positions, verl's default of a left-padded row (``0, 0, ..., 0, 1, 2, ...``)
would put the wrong positions on the real tokens, so a one-sequence ``[1, t]`` tensor that starts ``0, 0`` and
steps by 0 or 1 is taken as verl's default (each token's position in its sequence, chosen on the device with
``torch.where``).  Packed positions of one sequence whose first two tokens both sit at position 0 are therefore
not honoured; nothing else is affected (verl's default without left padding is the same numbers either way).
"""

from __future__ import annotations

import torch
from torch import Tensor

from packfwd._validate import check_positions

__all__ = ["assert_per_sequence", "check_default_positions", "thd_positions"]


def thd_positions(position_ids: Tensor | None, params, tokens: int | None, cp_size: int = 1,
                  cp_rank: int = 0) -> Tensor | None:
    """The positions to run a THD batch on (module docstring): ``[1, t]`` / ``[k, 1, t]`` (read), or None (each
    token's position in its own sequence).  ``tokens``: ``t``, the local packed tokens (None: not known here, on
    a stage that sees neither ids nor hidden states).

    >>> from megatron.core.packed_seq_params import PackedSeqParams
    >>> cu = torch.tensor([0, 4, 6], dtype=torch.int32)   # verl's: padded lengths 4 and 2 in both fields
    >>> params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_q_padded=cu)
    >>> thd_positions(torch.tensor([[0, 0, 1, 2], [0, 1, 1, 1]]), params, 6) is None   # verl's default
    True
    >>> thd_positions(torch.arange(6)[None], params, 6).tolist()                         # packed: read
    [[0, 1, 2, 3, 4, 5]]
    >>> thd_positions(torch.tensor([[3, 3, 4, 5], [3, 4, 4, 4]]), params, 6)
    Traceback (most recent call last):
    ...
    ValueError: position_ids [2, 4] beside a THD batch of 2 sequences is not verl's default [b, s] positions (each row clamp(cumsum(mask) - 1, min=0) of its row, which the model would not read): pass the packed positions [1, t] = [1, 6] (packfwd.pack_positions(position_ids, plan), or make_forward('thd')), or None for each token's position in its own sequence
    """
    if position_ids is None:
        return None
    check_positions(position_ids, None)  # an integer tensor of 2 or 3 dims
    shape, n = tuple(position_ids.shape), _sequences(params)
    packed = shape[-2:] == (1, tokens) if tokens is not None else shape[-2:-1] == (1,)
    if len(shape) == 3 and packed:
        return position_ids  # [k, 1, t]
    if len(shape) == 2 and packed:
        if n == 1 and shape[1] >= 2:  # the one ambiguous case (module docstring): verl's left-padded default
            return _unless_left_padded_default(position_ids, params, cp_size, cp_rank)
        return position_ids
    if len(shape) == 2 and shape[0] == n:
        check_default_positions(position_ids, params, tokens)
        return None
    want = f"[1, {tokens}]" if tokens is not None else "[1, t]"
    raise ValueError(
        f"position_ids has shape {list(shape)} beside a THD batch of {n} sequences and "
        f"{tokens if tokens is not None else 't'} packed tokens: "
        f"pass the packed positions {want} ([3, 1, t] for multimodal RoPE; packfwd.pack_positions(position_ids, "
        f"plan), or make_forward('thd')), None for each token's position in its own sequence, or verl's default "
        f"[b, s] = [{n}, s] positions (clamp(cumsum(mask) - 1, min=0), not read)"
    )


def check_default_positions(position_ids: Tensor, params, tokens: int | None = None) -> None:
    """Raise (CPU) or assert on the device (CUDA) unless ``position_ids [n, s]`` are verl's default positions of
    the batch ``params`` describes (the checks of the module docstring)."""
    rows = position_ids.to(torch.long)
    cu_real = params.cu_seqlens_q
    cu_padded = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else cu_real
    real, padded = cu_real.diff().to(rows.device), cu_padded.diff().to(rows.device)
    if rows.shape[1] == 0:
        ok = (real == 0).all()
    else:
        last = rows[:, -1]
        most = last + 1  # the row's real tokens: last + 1, or 0 (an empty row) when its last value is 0
        least = torch.where(last == 0, torch.zeros_like(most), most)
        steps = rows.diff(dim=1)
        ok = ((rows[:, 0] == 0).all() & ((steps >= 0) & (steps <= 1)).all() & (least <= padded).all()
              & ((real == padded) | ((least <= real) & (real <= most))).all())
    want = f"[1, {tokens}]" if tokens is not None else "[1, t]"
    message = (
        f"position_ids {list(position_ids.shape)} beside a THD batch of {position_ids.shape[0]} sequences is not "
        "verl's default [b, s] positions (each row clamp(cumsum(mask) - 1, min=0) of its row, which the model would "
        f"not read): pass the packed positions [1, t] = {want} (packfwd.pack_positions(position_ids, plan), or "
        "make_forward('thd')), or None for each token's position in its own sequence"
    )
    _raise_unless(ok, message, "position_ids [b, s] beside a THD batch are not verl's default positions; pass the "
                  "packed [1, t] (packfwd.pack_positions), None, or verl's default")


def assert_per_sequence(positions: Tensor, params, cp_size: int, cp_rank: int) -> None:
    """For a model built with ``packed_rope=False``: caller positions ``[t]`` other than each token's position in
    its own sequence would be silently ignored by Megatron-Core's THD RoPE, so they raise (asynchronously on
    CUDA)."""
    from packfwd.layout.rules import local_positions

    want = local_positions(_cu_padded(params), positions.shape[0], cp_size, cp_rank).to(positions.device)
    message = ("this model was built with packed_rope=False: Megatron-Core's THD RoPE uses each token's position "
               "in its own sequence and cannot take other position_ids; build it with packed_rope=True")
    _raise_unless((positions == want).all(), message, message)


def _unless_left_padded_default(position_ids: Tensor, params, cp_size: int, cp_rank: int) -> Tensor:
    """One sequence, ``[1, t]``: the tensor, or each token's position in its sequence where the tensor is verl's
    default of a left-padded row (starts ``0, 0``, steps by 0 or 1).  Chosen on the device, no host sync."""
    from packfwd.layout.rules import local_positions

    row = position_ids[0]
    steps = row.diff()
    default = (row[0] == 0) & (row[1] == 0) & ((steps >= 0) & (steps <= 1)).all()
    own = local_positions(_cu_padded(params), row.shape[0], cp_size, cp_rank).to(row.device, row.dtype)
    return torch.where(default, own, row)[None]


def _cu_padded(params) -> Tensor:
    return params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q


def _sequences(params) -> int:
    return _cu_padded(params).shape[0] - 1


def _raise_unless(ok: Tensor, message: str, short: str) -> None:
    """ValueError(``message``) unless ``ok``: at once on the CPU; on CUDA a device assert with ``short`` (torch
    takes under 255 characters), no host sync."""
    if ok.device.type == "cpu":
        if not bool(ok):
            raise ValueError(message)
    else:
        torch._assert_async(ok, short)
