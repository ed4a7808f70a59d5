"""verl's R3 router replay inputs for :func:`packfwd.verl.gptmodel_forward_model_engine`.

In verl 0.9.1's R3 mode the rollout engine's routes are replayed everywhere but at each sequence's last token:
a rollout records the route used to predict each generated token, so it has none for the final one (its route
list is one row short, or full length), and no log-prob reads the final token's output.  verl pads a short route
list with one placeholder row of zeros and marks, per token, where to replay: every token but each sequence's
last, and no token of a sequence without a response token.  Tokens not replayed are routed natively by the current
router.  :func:`r3_replay_inputs` builds the same two inputs, which the drop-in takes as ``routed_experts=`` and
``replay_mask=`` (packfwd's replay with a per-token mask: :class:`packfwd.forward.moe.RoutingReplay`).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["r3_replay_inputs"]


def r3_replay_inputs(routed_experts: Tensor, input_ids: Tensor, response_mask: Tensor) -> tuple[Tensor, Tensor]:
    """``(routed_experts [b, j, L, k], replay_mask [b, j])``, both jagged like ``input_ids``: the rollout's routes
    (jagged ``[b, j', L, k]``, each sequence's ``j'`` its ``j`` or ``j - 1``) with a row of zeros appended where
    one is short, and True at every token but each sequence's last, all False for a sequence whose
    ``response_mask`` (``[b, r]``, padded or jagged, verl's ``response_mask``) holds no response token.  Two host
    reads of the lengths, to check them and size the result (verl reads them too).

    >>> ids = torch.nested.nested_tensor([torch.tensor([5, 6, 7]), torch.tensor([8, 9])], layout=torch.jagged)
    >>> routes = torch.nested.nested_tensor([torch.tensor([[[1, 2]], [[3, 0]]]), torch.tensor([[[2, 3]], [[0, 1]]])],
    ...                                     layout=torch.jagged)  # [b, j', L=1, k=2]: the first one row short
    >>> aligned, mask = r3_replay_inputs(routes, ids, torch.tensor([[1, 1], [0, 0]]))
    >>> aligned.values()[:, 0].tolist(), mask.values().tolist()
    ([[1, 2], [3, 0], [0, 0], [2, 3], [0, 1]], [True, True, False, False, False])
    """
    if not (isinstance(input_ids, Tensor) and input_ids.is_nested):
        raise TypeError("input_ids must be a jagged nested tensor [b, j] (torch.nested, layout=torch.jagged)")
    if not (isinstance(routed_experts, Tensor) and routed_experts.is_nested and routed_experts.dim() == 4):
        raise TypeError("routed_experts must be the rollout's routes, jagged [b, j', L, k] (torch.nested with "
                        "layout=torch.jagged), j' each sequence's length or one less")
    b = input_ids.shape[0]
    if not isinstance(response_mask, Tensor) or response_mask.dim() != 2 or response_mask.shape[0] != b:
        got = tuple(response_mask.shape) if isinstance(response_mask, Tensor) else type(response_mask).__name__
        raise ValueError(f"response_mask has shape {got}; pass verl's response mask [b={b}, r] "
                         "(padded or jagged), 1 at response tokens")
    offsets = input_ids.offsets()
    lengths = offsets.diff()
    route_offsets = routed_experts.offsets().to(offsets.device)
    short = lengths - route_offsets.diff()
    if routed_experts.shape[0] != b or not bool(((short == 0) | (short == 1)).all()):
        raise ValueError(f"routed_experts has sequences of lengths {route_offsets.diff().tolist()} for input_ids of "
                         f"lengths {lengths.tolist()}; pass one route per token, or per token but the last")
    values = routed_experts.values()  # [t', L, k]
    token = torch.arange(int(offsets[-1]), device=offsets.device)  # [t]
    seq = torch.searchsorted(offsets[1:], token, right=True)
    place = token - offsets[seq]  # each token's place in its sequence
    has_route = place < (lengths - short)[seq]
    source = (route_offsets[seq] + place).clamp(max=max(values.shape[0] - 1, 0)).to(values.device)
    rows = values[source] if values.shape[0] else values.new_zeros(token.shape[0], *values.shape[1:])
    aligned = torch.where(has_route.to(values.device)[:, None, None], rows, torch.zeros_like(rows))
    padded = response_mask.to_padded_tensor(0) if response_mask.is_nested else response_mask
    answered = (padded != 0).any(-1).to(offsets.device)  # [b]: a sequence with a response token
    replay = (place < lengths[seq] - 1) & answered[seq]
    return (torch.nested.nested_tensor_from_jagged(aligned, offsets.to(values.device)),
            torch.nested.nested_tensor_from_jagged(replay, offsets))
