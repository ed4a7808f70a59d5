"""packfwd's token dispatchers: a combine whose sum over a token's experts has a fixed order, and expert
parallelism whose ranks hold batches of different shapes.

:class:`OrderedCombineDispatcher` (every MoE layer with Megatron-Core's ``"allgather"`` dispatcher, one
expert-parallel rank or more): Megatron-Core returns the experts' outputs to their tokens with ``scatter_add_``
(atomic adds in the output dtype outside torch's deterministic mode: their order, and so the bits, change run to
run and with whatever else is in the batch).  packfwd's combine instead gathers each token's ``K`` expert outputs
(``K = min(top_k, local experts)``; slots of experts the token did not reach read a zero) in ascending expert order
and sums them: a token's output depends on its own expert outputs only, the same bits run to run and in any batch;
no atomics, the backward a gather of the gradient (each expert row is read once).  The permutation before the
experts is the mirror image (:func:`ordered_permute`: a gather forward; backward, where Megatron-Core's adds a
token's rows with atomic ``index_add_``, the same ordered sum), so the MoE layer's input gradient is the same bits
run to run without torch's deterministic mode.  :func:`ordered_unpermute`.

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
:class:`~packfwd.models.mlp.router.PackedRouter`'s layout pads), so it counts in no expert's load and its output, zero,
is cut off before the layer returns.  Backward: the reduce-scatter's gradient is an all-gather of the same padded
shape, so each rank's experts get the gradient of every rank's loss for the tokens routed to them.

On the CPU (gloo) the gather and reduce-scatter allocate on ``torch.cuda.current_device()``: the forward enters
:func:`packfwd.models.runtime.cpu.host_collectives` by itself; run the backward inside it (as for sequence parallelism).
:func:`pad_expert_parallel` gives the MoE layers of a model this dispatcher when the expert-parallel group has
more than one rank (:func:`packfwd.models.build_model` calls it; with one rank, nothing is gathered and the layers
stay Megatron-Core's unchanged).
"""

from __future__ import annotations

import contextlib
from typing import NamedTuple

import torch
import torch.distributed as dist
from megatron.core.transformer.moe.token_dispatcher import MoEAllGatherTokenDispatcher
from torch import Tensor

from packfwd.ops.gather import take_rows
from packfwd.ops.slot_sum import slot_sum

from packfwd.parallel.host import host_collectives
from .experts import GroupedExperts

__all__ = ["FixedRows", "OrderedCombineDispatcher", "PaddedAllGatherDispatcher", "fixed_permute", "fixed_rows",
           "ordered_permute", "ordered_unpermute", "pad_expert_parallel"]


def pad_expert_parallel(model: torch.nn.Module) -> torch.nn.Module:
    """``model`` (in place) with every MoE layer's ``"allgather"`` token dispatcher made packfwd's: a
    :class:`PaddedAllGatherDispatcher` over more than one expert-parallel rank, else an
    :class:`OrderedCombineDispatcher`; other dispatchers under expert parallelism are a ValueError (they assume
    equal shapes or CUDA).  Returns ``model``.

    >>> pad_expert_parallel(torch.nn.Linear(2, 2))  # no MoE layer: unchanged
    Linear(in_features=2, out_features=2, bias=True)
    """
    for module in model.modules():
        dispatcher = getattr(module, "token_dispatcher", None)
        if dispatcher is None:
            continue
        if not isinstance(dispatcher, MoEAllGatherTokenDispatcher):
            if dispatcher.ep_size == 1:
                continue
            raise ValueError(f"{type(dispatcher).__name__} under expert parallelism: packfwd pads the ranks' tokens "
                             "in Megatron-Core's 'allgather' dispatcher only; use "
                             "moe_token_dispatcher_type='allgather'")
        # methods, and the experts' choice of path (the grouped experts take fixed_rows' layout)
        dispatcher.__class__ = PaddedAllGatherDispatcher if dispatcher.ep_size > 1 else OrderedCombineDispatcher
        experts = getattr(module, "experts", None)
        if isinstance(experts, GroupedExperts):
            dispatcher.experts_grouped = experts.use_grouped
    return model


def ordered_unpermute(permuted: Tensor, routing_map: Tensor, top_k: int, token_of_row: Tensor,
                      slots: tuple[Tensor, Tensor] | None = None) -> Tensor:
    """The tokens' outputs ``[t, h]`` from their experts' ``permuted [n, h]`` (rows sorted by expert, then token:
    Megatron-Core's ``permute`` of ``routing_map [t, E]`` bool; ``token_of_row [n]`` the token of each row, its
    ``sorted_indices``), each token's row the sum over its experts in ascending expert order of at most
    ``min(top_k, E)`` outputs (a token routed nowhere: zeros), bf16 / fp16 summed in float32 and rounded once.  No
    atomics and no host sync; a token's bits depend on its own rows only.  Backward: the gradient of row ``r`` is
    the output gradient of its token (a gather: each row belongs to one token).  ``slots``: :func:`token_slots` of
    the same map, when the caller has them (:func:`ordered_permute` returns them).

    >>> rmap = torch.tensor([[True, False, True], [False, True, False], [False, False, False]])
    >>> permuted = torch.tensor([[1.0], [20.0], [300.0]])  # expert 0: token 0; 1: token 1; 2: token 0
    >>> ordered_unpermute(permuted, rmap, top_k=2, token_of_row=torch.tensor([0, 1, 0])).flatten().tolist()
    [301.0, 20.0, 0.0]
    """
    if permuted.shape[0] == 0:
        return permuted.new_zeros(routing_map.shape[0], permuted.shape[-1])
    picked, valid = slots if slots is not None else token_slots(routing_map, top_k, permuted.shape[0])
    return _OrderedCombine.apply(permuted, picked, valid, token_of_row)


def ordered_permute(tokens: Tensor, routing_map: Tensor, top_k: int) -> tuple[Tensor, Tensor, tuple[Tensor, Tensor]]:
    """``(permuted [n, h], token_of_row [n], slots)``: the rows of ``tokens [t, h]`` routed to each expert of
    ``routing_map [t, E]``, sorted by expert then token (Megatron-Core's ``permute``, its ``sorted_indices``), n =
    the routed pairs (learning it is a host sync, as Megatron-Core's ``permute``), and :func:`token_slots` for the
    combine.  Backward: a token's gradient is the sum of its rows' in ascending expert order
    (:func:`ordered_unpermute`'s forward), no atomics.

    >>> rmap = torch.tensor([[True, False, True], [False, True, False]])
    >>> permuted, rows, _ = ordered_permute(torch.tensor([[1.0], [2.0]]), rmap, top_k=2)
    >>> permuted.flatten().tolist(), rows.tolist()
    ([1.0, 2.0, 1.0], [0, 1, 0])
    """
    t = routing_map.shape[0]
    by_expert = routing_map.bool().T.contiguous()  # [E, t]
    token_of_row = torch.arange(t, device=routing_map.device).expand_as(by_expert).masked_select(by_expert)
    slots = token_slots(routing_map, top_k, token_of_row.shape[0])
    return _OrderedPermute.apply(tokens, *slots, token_of_row), token_of_row, slots


def token_slots(routing_map: Tensor, top_k: int, n: int) -> tuple[Tensor, Tensor]:
    """``(picked [t, k], valid [t, k])``: each token's rows of the ``n`` routed pairs (:func:`ordered_permute`'s
    rows: :func:`fixed_rows`' without the sinks) in ascending expert order, k = ``min(top_k, E)`` slots
    (``valid`` False past the experts it reached; ``picked`` then any row below ``n``).  A token routed to more
    than k experts fails a device-side assert (:func:`fixed_rows`)."""
    rows = fixed_rows(routing_map, top_k)
    return rows.picked.clamp(max=max(n - 1, 0)), rows.valid


class FixedRows(NamedTuple):
    """The permutation of :func:`fixed_rows`: ``t * k`` rows whatever the routing (module docstring)."""

    token_of_row: Tensor  # [t * k] the token of each row
    picked: Tensor        # [t, k] each token's rows, its experts ascending
    valid: Tensor         # [t, k] False at a sink slot (an expert the token did not reach)
    order: Tensor         # [t * k] the slot (token * k + j) each row holds
    columns: Tensor       # [t, k] each slot's expert; at a sink an expert the token did not reach (distinct in a row)
    counts: Tensor        # [E] int64 rows per expert, on the device (the sinks follow the last expert's)

    def probs(self, probs: Tensor) -> Tensor:
        """The routing probabilities ``probs [t, E]`` of each row ``[t * k]``: 0 at a sink row (a ``where``, so
        no gradient reaches ``probs`` from a sink, whatever the experts computed there; a row's columns are
        distinct, so the gather's backward adds nothing twice)."""
        per_slot = probs.gather(1, self.columns)
        per_slot = torch.where(self.valid, per_slot, per_slot.new_zeros(()))
        return per_slot.flatten().index_select(0, self.order)


def fixed_rows(routing_map: Tensor, top_k: int) -> FixedRows:
    """The permutation of the grouped experts without a host sync: ``t * k`` rows (``k = min(top_k, E)``) for
    ``routing_map [t, E]`` whatever it routes, sorted by expert then token as Megatron-Core's ``permute`` (so the
    real rows, and the experts' GEMMs over them, are the same as :func:`ordered_permute`'s), then the sink rows
    (slots of experts a token did not reach: layout pads, tokens whose experts live on another rank), which no
    expert's group covers.  ``counts`` stay on the device: the grouped GEMM reads its offsets there.  A token
    routed to more than k experts fails a device-side assert.

    >>> rmap = torch.tensor([[True, False, True], [False, True, False]])
    >>> rows = fixed_rows(rmap, top_k=2)
    >>> rows.token_of_row.tolist(), rows.counts.tolist(), rows.valid.tolist()
    ([0, 1, 0, 1], [1, 1, 1], [[True, True], [True, False]])
    """
    t, e = routing_map.shape
    k = max(1, min(top_k, e))
    routing_map = routing_map.bool()
    torch._assert_async((routing_map.sum(1) <= k).all(), f"a token routed to more than top_k={top_k} experts")
    ids = torch.arange(e, dtype=torch.int32, device=routing_map.device)
    keyed = torch.where(routing_map, ids, torch.full_like(ids, e))  # [t, E]: the expert, or E (no expert)
    experts, columns = keyed.topk(k, dim=1, largest=False, sorted=True)  # [t, k] ascending, sinks (E) last
    order = torch.sort(experts.flatten(), stable=True).indices  # rows by expert, then token; sinks last
    picked = torch.empty_like(order).scatter_(0, order, torch.arange(t * k, device=order.device)).view(t, k)
    return FixedRows(torch.div(order, k, rounding_mode="floor"), picked, experts < e, order, columns,
                     routing_map.sum(0))


def fixed_permute(tokens: Tensor, rows: FixedRows) -> Tensor:
    """``tokens [t, h]`` in :func:`fixed_rows`' order, ``[t * k, h]``; backward a token's rows summed in ascending
    expert order, sink rows never read (their gradient may be anything: the grouped GEMMs leave them unwritten)."""
    return _OrderedPermute.apply(tokens, rows.picked, rows.valid, rows.token_of_row)


class _OrderedCombine(torch.autograd.Function):
    """``out[t] = sum_j valid[t, j] * permuted[picked[t, j]]`` (j ascending); backward a gather by
    ``token_of_row`` (each row of ``permuted`` is exactly one valid ``(t, j)``): no atomics, no zero-fill."""

    @staticmethod
    def forward(ctx, permuted, picked, valid, token_of_row):
        ctx.save_for_backward(token_of_row)
        return slot_sum(permuted, picked, valid)

    @staticmethod
    def backward(ctx, grad):
        (token_of_row,) = ctx.saved_tensors
        return take_rows(grad, token_of_row), None, None, None


class _OrderedPermute(torch.autograd.Function):
    """``tokens[token_of_row]``; backward each token's rows (``picked``, ``valid``: :func:`token_slots`) summed in
    ascending expert order (no atomics)."""

    @staticmethod
    def forward(ctx, tokens, picked, valid, token_of_row):
        ctx.save_for_backward(picked, valid)
        return take_rows(tokens, token_of_row)

    @staticmethod
    def backward(ctx, grad):
        picked, valid = ctx.saved_tensors
        return slot_sum(grad, picked, valid), None, None, None


class OrderedCombineDispatcher(MoEAllGatherTokenDispatcher):
    """Megatron-Core's all-gather token dispatcher with :func:`ordered_permute` / :func:`ordered_unpermute` as its
    permutation and combine (module docstring): a token's output, and its gradient, sum its experts' in ascending
    expert order, whatever its batch."""

    def dispatch_postprocess(self, hidden_states: Tensor, probs: Tensor):
        """Megatron-Core's: this rank's experts' tokens, sorted by expert; the permutation packfwd's."""
        self.hidden_shape_before_permute = hidden_states.shape
        lo, hi = self.local_expert_indices[0], self.local_expert_indices[-1] + 1
        self.local_map = self.routing_map[:, lo:hi].contiguous()
        self.routing_map = None
        top_k = self.config.moe_router_topk
        grouped = getattr(self, "experts_grouped", None)
        if grouped is not None and hidden_states.shape[0] and grouped(hidden_states):
            # the grouped experts: t * k rows, no host sync (fixed_rows)
            rows = fixed_rows(self.local_map, top_k)
            self.reversed_local_input_permutation_mapping = rows.token_of_row
            self.token_slots = (rows.picked, rows.valid)
            self.local_probs = rows.probs(probs[:, lo:hi])
            return fixed_permute(hidden_states, rows), rows.counts, self.local_probs
        tokens_per_expert = self.local_map.sum(dim=0).long().cpu()  # Megatron-Core's sequential experts read it
        permuted, self.reversed_local_input_permutation_mapping, self.token_slots = ordered_permute(
            hidden_states, self.local_map, top_k)
        self.local_probs = probs[:, lo:hi].T.contiguous().masked_select(self.local_map.T.contiguous())
        return permuted, tokens_per_expert, self.local_probs

    def combine_preprocess(self, hidden_states: Tensor) -> Tensor:
        shape = self.hidden_shape_before_permute
        out = ordered_unpermute(hidden_states, self.local_map, self.config.moe_router_topk,
                                self.reversed_local_input_permutation_mapping, self.token_slots)
        self.token_slots = None
        return out.view(shape)


class PaddedAllGatherDispatcher(OrderedCombineDispatcher):
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
