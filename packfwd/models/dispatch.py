"""Expert parallelism whose ranks hold batches of different shapes: packfwd's MoE layer and its token dispatcher.

Megatron-Core's ``"allgather"`` token dispatcher gathers every token of the tensor- and expert-parallel group
(``tp_ep``) to every rank of it, each rank runs its own experts on the tokens routed to them, and a reduce-scatter
hands each rank back the outputs of its own tokens.  Its all-gather and reduce-scatter split the tokens in equal
parts: it assumes every rank holds as many tokens as the others.  Expert-parallel ranks are data-parallel ranks,
each with its own batch (``b`` and ``s`` of its own, THD streams of their own length), so they do not.  With TP
(sequence parallelism; the experts' TP size is TP's) each TP rank holds its slice of its expert-parallel rank's
stream: the slices of one batch are equal, those of another batch are not, and all are padded alike.

:class:`PaddedAllGatherDispatcher` pads this rank's tokens to the most any rank of the group holds, learnt with one
all-reduce (MAX) of an integer per MoE layer and forward, a host sync (learning a max length is the one sync
packfwd allows; Megatron-Core's ``SequentialMLP`` already syncs on its experts' token counts).  A pad slot is
routed to no expert (its routing-map row is empty, its probabilities 0: the same rule as
:class:`~packfwd.models.router.PackedRouter`'s layout pads), so it counts in no expert's load and its output, zero,
is cut off before the layer returns.  Backward: the reduce-scatter's gradient is an all-gather of the same padded
shape, so each rank's experts get the gradient of every rank's loss for the tokens routed to them.

On the CPU (gloo) the gather and reduce-scatter allocate on ``torch.cuda.current_device()``: the forward enters
:func:`packfwd.models.cpu.host_collectives` by itself; run the backward inside it (as for sequence parallelism).
:func:`pad_expert_parallel` gives the MoE layers of a model this dispatcher when the expert-parallel group has
more than one rank (:func:`packfwd.models.build_model` calls it; with one rank, nothing is gathered and the layers
stay Megatron-Core's unchanged).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from torch import Tensor

from .cpu import host_collectives

__all__ = ["PaddedAllGatherDispatcher", "pad_expert_parallel"]


def pad_expert_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (in place) with every MoE layer's ``"allgather"`` token dispatcher over more than one
    expert-parallel rank made a :class:`PaddedAllGatherDispatcher`; other dispatchers under expert parallelism are
    a ValueError (they assume equal shapes or CUDA).  Returns ``model``.

    >>> pad_expert_parallel(torch.nn.Linear(2, 2))  # no MoE layer: unchanged
    Linear(in_features=2, out_features=2, bias=True)
    """
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None or dispatcher.ep_size == 1:
            continue
        if not isinstance(dispatcher, MoEAllGatherTokenDispatcher):
            raise ValueError(f"{type(dispatcher).__name__} under expert parallelism: packfwd pads the ranks' tokens "
                             "in Megatron-Core's 'allgather' dispatcher only; use "
                             "moe_token_dispatcher_type='allgather'")
        dispatcher.__class__ = PaddedAllGatherDispatcher  # adds no state: methods only
    return model


class PaddedAllGatherDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron-Core's all-gather token dispatcher over ranks holding different numbers of tokens (module
    docstring): this rank's ``n`` tokens padded to the group's most, pads routed nowhere, cut off at the end."""

    local_tokens: int = 0

    def dispatch_preprocess(self, hidden_states: Tensor, routing_map: Tensor, probs: Tensor):
        hidden, probs = super().dispatch_preprocess(hidden_states, routing_map, probs)
        n = hidden.shape[0]
        most = torch.tensor([n], dtype=torch.int64, device=hidden.device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.tp_ep_group)
        self.local_tokens, pad = n, int(most.item()) - n
        if pad:
            hidden = torch.cat([hidden, hidden.new_zeros(pad, hidden.shape[1])])
            probs = torch.cat([probs, probs.new_zeros(pad, probs.shape[1])])
            self.routing_map = torch.cat([self.routing_map, self.routing_map.new_zeros(pad, probs.shape[1])])
        return hidden, probs

    def token_dispatch(self, hidden_states: Tensor, probs: Tensor):
        with _on_host(hidden_states):
            return super().token_dispatch(hidden_states, probs)

    def token_combine(self, hidden_states: Tensor):
        with _on_host(hidden_states):
            return super().token_combine(hidden_states)

    def combine_postprocess(self, hidden_states: Tensor) -> Tensor:
        return hidden_states[:self.local_tokens].view(self.hidden_shape)


def _on_host(t: Tensor):
    return host_collectives() if t.device.type == "cpu" else contextlib.nullcontext()
