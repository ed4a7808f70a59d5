"""Router replay and recording at each MoE layer: the experts a token goes to, given or kept.

RL trainers route each token to the experts a rollout engine chose (R3) or that their own first pass chose (R2),
so that a small change of the router between rollout and update does not move a token to other experts.  In a
layer, replay is the top-k *selection* replaced by the given experts; everything else is the family's own
routing: Megatron-Core's ``topk_routing_with_score_function`` takes a ``router_replay`` hook for exactly the
selection (its ``compute_topk``), so the weights are what the current router gives the given experts as the family
computes them (softmax families: the softmax over all experts gathered at them, or the softmax over their logits
when the family normalises top-k; sigmoid families: the scores at them, normalised and scaled; a selection-only
expert bias never enters a weight).  The router therefore still learns through the weights.

:class:`LayerRouting` is that hook for one layer and one forward: ``target [n, k]`` (this rank's tokens, in the
router's row order) replaces the selection; ``replay [n]`` (bool, optional) limits that to the tokens where it is
True, the others keep the router's own top-k (the selection and its values exactly as without a hook, whatever the
target holds there, as long as its ids are valid experts); ``record=True`` keeps the selection used (the target's
or the router's, token by token).
:func:`routing_hooks` installs one per router for the length of a forward.  Padding rows are emptied by the router
afterwards (:class:`~packfwd.models.mlp.router.PackedRouter`), whatever the target holds there, as long as the
ids are valid experts (the forward puts ``0..k-1`` at padding).  No Megatron-Core import.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import torch
from torch import Tensor

__all__ = ["LayerRouting", "routing_hooks"]


class LayerRouting:
    """Megatron-Core's ``router_replay`` hook of one MoE layer for one forward (module docstring).

    >>> scores = torch.tensor([[0.1, 0.7, 0.2], [0.5, 0.3, 0.2]])
    >>> hook = LayerRouting(target=torch.tensor([[2], [1]]), record=True)
    >>> hook.get_replay_topk(scores, 1, None, None, None)
    (tensor([[0.2000],
            [0.3000]]), tensor([[2],
            [1]]))
    >>> hook.recorded.tolist()
    [[2], [1]]
    >>> mixed = LayerRouting(target=torch.tensor([[2], [1]]), replay=torch.tensor([True, False]), record=True)
    >>> mixed.get_replay_topk(scores, 1, None, None, lambda s, k, g, t: s.topk(k, dim=1))[1].tolist()
    [[2], [0]]
    """

    def __init__(self, target: Tensor | None = None, record: bool = False, replay: Tensor | None = None):
        self.target, self.record, self.replay, self.recorded = target, record, replay, None

    def get_replay_topk(self, scores: Tensor, topk: int, num_groups, group_topk, compute):
        """``(values [n, k], indices [n, k])`` of the selection: the target's, or ``compute``'s (Megatron-Core's
        own top-k, group-limited or not), or token by token the one or the other where ``replay`` is given."""
        if self.target is None:
            values, indices = compute(scores, topk, num_groups, group_topk)
        else:
            indices = self.target.to(device=scores.device, dtype=torch.long)
            if indices.shape != (scores.shape[0], topk):
                raise ValueError(f"routed_experts gives this MoE layer {tuple(indices.shape)} experts for its "
                                 f"{scores.shape[0]} tokens; it routes top-{topk}: pass [..., layers, {topk}]")
            if self.replay is None:
                values = scores.gather(1, indices)
            else:  # the router's own top-k where not replayed: its values and indices as without a hook
                if self.replay.shape != (scores.shape[0],):
                    raise ValueError(f"replay_mask gives this MoE layer {tuple(self.replay.shape)} flags for its "
                                     f"{scores.shape[0]} tokens; pass one bool per token, [b, s] like input_ids")
                native_values, native = compute(scores, topk, num_groups, group_topk)
                here = self.replay.to(scores.device)[:, None]
                indices = torch.where(here, indices, native)
                values = torch.where(here, scores.gather(1, indices), native_values)
        if self.record:
            self.recorded = indices
        return values, indices


@contextlib.contextmanager
def routing_hooks(routers: Sequence[torch.nn.Module], targets: Sequence[Tensor | None],
                  record: bool, replay: Tensor | None = None) -> Iterator[list[LayerRouting]]:
    """While open, router ``i`` replays ``targets[i]`` (None: selects itself) at the tokens where ``replay [n]``
    is True (None: every token) and, with ``record``, keeps its selection; yields the hooks (their ``recorded``
    filled by the forward).  The routers' own hooks come back after, whatever happens."""
    hooks = [LayerRouting(t, record, None if t is None else replay) for t in targets]
    saved = [getattr(r, "router_replay", None) for r in routers]
    if any(isinstance(s, LayerRouting) for s in saved):
        raise RuntimeError("routing hooks are already installed on this model; one forward at a time")
    try:
        for r, h in zip(routers, hooks):
            r.router_replay = h
        yield hooks
    finally:
        for r, s in zip(routers, saved):
            r.router_replay = s
