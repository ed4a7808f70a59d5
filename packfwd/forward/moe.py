"""``make_forward(..., moe_aux_loss=True)``: the engine extension that gives ``"moe_aux_loss"``, the
load-balancing loss of the batch's real tokens, every MoE layer of the decoder pooled as transformers'
``load_balancing_loss_func`` pools them (:func:`packfwd.models.mlp.routing.load_balancing_loss`).

The routers record their statistics while the model runs (:func:`packfwd.models.mlp.moe.routing_stats`, the
decoder's routers only: an MTP block's MoE layers, which transformers never runs, are not pooled, so the loss is
the same with ``mtp=True`` or not).  On pipeline stages a stage before the last hands on ``(hidden, routing
sums)`` (:func:`~packfwd.models.mlp.aux_loss.stage_routing_sums`, its layers pooled plus those it was given as
``moe_routing=``), and the last stage pools them into the loss.  Carried sums are checked against this batch: the
tokens they count must be a whole number of this batch's real tokens per MoE layer (another micro-batch's sums
raise, eagerly on the CPU, with ``torch._assert_async`` on CUDA).

``make_forward(..., record_routing=True)`` (:class:`RoutingReplay`) records on pipeline stages the same way: a
stage before the last hands on its record with its hidden states, and the last stage's ``"routed_experts"`` holds
every stage's MoE layers joined in layer order, the whole model's record.  What a stage hands on is a tuple
``(hidden, *carried)``, one entry per extension that carries something, in the forward's extension order (the
record, then the routing sums); ``forward.carried`` names the keyword each entry goes to on the next stage.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from .._validate import unwrap
from ..engine import Extension, is_moe, seq_major
from ..models.mlp.aux_loss import check_stage_routing, model_aux_loss, stage_routing_sums
from ..models.mlp.moe import routing_stats

__all__ = ["MoeAuxLoss", "RoutingReplay"]


class MoeAuxLoss(Extension):
    """The MoE load-balancing loss (module docstring); ``batch.options["moe_routing"]``: the earlier stages' sums."""

    def check(self, model, facts, batch) -> None:
        check_stage_routing(model, batch.options.get("moe_routing"), True)

    def context(self, step):
        @contextlib.contextmanager
        def recording():
            decoder = getattr(unwrap(step.model), "decoder", step.model)
            with routing_stats(decoder) as stats:
                step.state[self] = stats
                yield

        return recording()

    def hand_on(self, out, step):
        carried = self._carried(step)
        return (*_handed(out), stage_routing_sums(step.model, step.state[self], carried))

    def finish(self, out, step):
        loss = model_aux_loss(step.model, step.state[self], device=step.ids.device, carried=self._carried(step))
        return out, {"moe_aux_loss": loss}

    def _carried(self, step):
        """The given sums, checked to count a whole number of this batch's routed tokens per layer."""
        carried = step.batch.options.get("moe_routing")
        if carried is None:
            return None
        mask = step.call.get("padding_mask")  # True at slots kept from the routers (an MoE model always has one)
        routed = (~_router_rows(mask.reshape(-1).bool(), step)).sum()  # this rank's share under SP, as its routers
        tokens = carried[-1]
        ok = (tokens.remainder(torch.as_tensor(routed, dtype=tokens.dtype, device=tokens.device).clamp(min=1)) == 0)
        message = ("moe_routing= counts routed tokens that are not a whole number of this batch's real tokens per MoE "
                   "layer: it comes from another micro-batch; pass the previous stage's sums of this micro-batch")
        if tokens.device.type == "cpu":
            if not bool(ok):
                raise ValueError(f"{message} ({int(tokens)} carried, {int(routed)} real tokens here)")
        else:
            torch._assert_async(ok, message)
        return carried


class RoutingReplay(Extension):
    """``make_forward(record_routing=True)`` and the forward's ``routed_experts=``: recorded routing and router
    replay (:mod:`packfwd.models.mlp.replay`).  ``routed_experts [b, s, L, k]`` (``L``: this model's (stage's) MoE
    layers in layer order, ``k`` its top-k; jagged like jagged ids) travels with its tokens through the plan like
    every per-token input; a real token of MoE layer ``l`` goes to the experts ``[b, t, l, :]``, whatever is at
    padding is ignored.  ``replay_mask [b, s]`` (bool like the attention mask, jagged like jagged ids; optional,
    with ``routed_experts``): replay only where it is True; a token where it is False is routed by the current
    router's own top-k, as without replay, and its row of ``routed_experts`` is ignored (a placeholder is fine).
    ``routed_experts`` may also cover every decoder layer (``[b, s, num_layers, k]``, the whole model's, as a
    rollout engine may give them): each MoE layer then takes its own layer's row, the dense layers' rows are
    ignored.  ``record``: the outputs get ``"routed_experts" [b, s, L, k]``, int64, ``-1`` at padding (the experts
    used: replayed or the router's own, token by token).

    ``record`` on pipeline stages: each stage records its own MoE layers, and a stage before the last hands on
    ``(hidden, record)``, ``record [t', L_so_far, k]`` int64 (the layers of every stage up to it, joined in layer
    order; ``t'`` its packed tokens in the layout's token order, this CP rank's share, every TP rank's under
    sequence parallelism gathered; ``-1`` at the layout's pads).  The next stage takes it as
    ``recorded_routing=`` (``run_micro_batches(..., pp_group=...)`` hands it on), appends its own layers, and the
    last stage's ``"routed_experts" [b, s, L, k]`` is the whole model's record, bit for bit what the model run in
    one piece records.  A stage without MoE layers (all of them dense) hands the record on unchanged; the first one
    hands on ``[t', 0, k]``.  A carried record is checked against this batch: ``t'`` and ``k`` (eagerly), and its
    ``-1`` exactly at this batch's pads (eagerly on the CPU, ``torch._assert_async`` on CUDA: no host sync), so
    another micro-batch's record raises a ValueError naming ``recorded_routing``."""

    def __init__(self, record: bool):
        self.record = record

    def check(self, model, facts, batch) -> None:
        given, mask = batch.options.get("routed_experts"), batch.options.get("replay_mask")
        carried = batch.options.get("recorded_routing")
        if mask is not None and given is None:
            raise TypeError("replay_mask= (which tokens to replay) needs routed_experts= (the experts to replay "
                            "there); pass both, or drop replay_mask")
        if carried is not None and not self.record:
            raise TypeError(_CARRIED_ONLY)
        if given is None and not self.record:
            return
        found = _routers(model)
        # a record passes through a pipeline stage whose layers are all dense; a whole model must route somewhere
        routes = bool(found) or (self.record and given is None and is_moe(model)
                                 and not (facts.pre_process and facts.post_process))
        what = "routed_experts=" if given is not None else "record_routing=True"
        if not routes:
            raise ValueError(f"{what} on a model (or pipeline stage) without MoE layers: there is no routing to "
                             "replay or record; drop it for this model or stage")
        if self.record:
            _check_stage_record(facts, carried)
        if given is not None:
            if mask is not None:
                _check_replay_mask(mask, batch)
            config = unwrap(model).config
            _check_routed(_moe_layers(given, found, config), batch, len(found), config, mask)

    def inputs(self, step) -> dict:
        if self.record and step.batch.options.get("recorded_routing") is not None:
            step.state[(self, "carried")] = self._carried(step)  # checked while planning, before the model runs
        given, mask = step.batch.options.get("routed_experts"), step.batch.options.get("replay_mask")
        if given is None:
            return {}
        given = _moe_layers(given, _routers(step.model), unwrap(step.model).config)
        return {"routed_experts": given} if mask is None else {"routed_experts": given, "replay_mask": mask}

    def context(self, step):
        from ..models.mlp.replay import routing_hooks

        given = step.packed.get("routed_experts")
        if given is None and not self.record:
            return None
        found = _routers(step.model)
        targets, replay = [None] * len(found), None
        if given is not None:
            given, replay = self._sanitised(given, step.packed.get("replay_mask"), step)
            rows = _router_rows(given, step)  # [n_local, L, k]
            targets = [rows[:, i] for i in range(len(found))]
            replay = None if replay is None else _router_rows(replay, step)  # [n_local]

        @contextlib.contextmanager
        def hooked():
            with routing_hooks(found, targets, self.record, replay) as hooks:
                step.state[self] = hooks
                yield

        return hooked()

    def finish(self, out, step):
        if not self.record:
            return out, {}
        return out, {"routed_experts": step.unpack(self._record(step) + 1) - 1}  # -1 at padding

    def hand_on(self, out, step):
        if not self.record:
            return out
        return (*_handed(out), self._record(step))

    def _record(self, step) -> Tensor:
        """``[t', L, k]`` int64 in the layout's token order: the carried record (the earlier stages' layers) and
        this stage's, joined in layer order; ``-1`` at the layout's pads."""
        pads = step.layout.padding_mask(step.plan).reshape(-1)  # [t'] in token order
        hooks, k = step.state.get(self), unwrap(step.model).config.moe_router_topk
        if step.empty or not hooks:  # no model run (nothing routed), or a stage without MoE layers
            layers = len(_routers(step.model))
            rows = torch.full((pads.shape[0], layers, k), -1, dtype=torch.long,
                              device=step.ids.device if step.ids is not None else pads.device)
        else:
            rows = torch.stack([h.recorded for h in hooks], dim=1)  # [n_local, L, k], the routers' row order
            rows = _token_rows(rows, step).long()
            rows = rows.masked_fill(pads.to(rows.device)[:, None, None], -1)
        carried = step.state.get((self, "carried"))
        return rows if carried is None else torch.cat([carried.to(rows.device), rows], dim=1)

    @staticmethod
    def _carried(step) -> Tensor | None:
        """``recorded_routing`` (the earlier stages' record), checked against this batch: ``[t', L_before, k]``
        integer with ``t'`` this batch's packed tokens and ``k`` the model's top-k, ``-1`` exactly at this batch's
        pads (eagerly on the CPU, ``torch._assert_async`` on CUDA); int64."""
        carried = step.batch.options.get("recorded_routing")
        if carried is None:
            return None
        k = unwrap(step.model).config.moe_router_topk
        pads = step.layout.padding_mask(step.plan).reshape(-1)
        fix = ("pass the previous pipeline stage's record of this micro-batch (its forward's output[1], "
               "(hidden, record, ...)); run_micro_batches(..., pp_group=...) hands it on")
        if not isinstance(carried, Tensor) or carried.is_nested or carried.dtype.is_floating_point \
                or carried.dtype == torch.bool:
            got = (("jagged " if carried.is_nested else "") + str(carried.dtype)) if isinstance(carried, Tensor) \
                else type(carried).__name__
            raise TypeError(f"recorded_routing must be an integer tensor [t', L, k] (the packed record an earlier "
                            f"stage hands on), got {got}; {fix}")
        if carried.dim() != 3 or carried.shape[0] != pads.shape[0] or carried.shape[2] != k:
            raise ValueError(f"recorded_routing has shape {tuple(carried.shape)}; this batch packs {pads.shape[0]} "
                             f"tokens and the model routes top-{k}: it wants [{pads.shape[0]}, L, {k}] (L: the "
                             f"earlier stages' MoE layers). It comes from another micro-batch or model; {fix}")
        carried = carried.long()
        if carried.shape[1] and pads.shape[0]:
            ok = ((carried < 0) == pads.to(carried.device)[:, None, None]).all()
            if carried.device.type == "cpu":
                if not bool(ok):
                    raise ValueError("recorded_routing has -1 (padding) elsewhere than this batch's padding: it "
                                     f"comes from another micro-batch; {fix}")
            else:
                torch._assert_async(ok, CARRIED_ON_DEVICE)
        return carried

    @staticmethod
    def _sanitised(packed: Tensor, mask: Tensor | None, step) -> tuple[Tensor, Tensor | None]:
        """``(experts [t', L, k], replay [t'] or None)``: the packed experts with ``0..k-1`` at the layout's padding
        slots (any valid experts: the router empties those rows) and, with a packed ``replay_mask``, at the real
        tokens it leaves to the router, so that garbage never reaches a gather; ``replay``: where the hooks
        replay (the mask's real tokens and the padding slots, as without a mask)."""
        pads = step.layout.padding_mask(step.plan).reshape(-1).to(packed.device)  # [t'] in token order
        used = None if mask is None else mask.to(device=packed.device, dtype=torch.bool) & ~pads
        k = packed.shape[-1]
        spare = torch.arange(k, device=packed.device).expand_as(packed)
        experts = torch.where((pads if used is None else ~used)[:, None, None], spare, packed.long())
        return experts, None if used is None else used | pads


# torch._assert_async takes a message under 255 characters
CARRIED_ON_DEVICE = ("packfwd: recorded_routing has -1 (padding) elsewhere than this batch's padding: it is "
                     "another micro-batch's record; pass this micro-batch's own")
_CARRIED_ONLY = ("recorded_routing= (the record an earlier pipeline stage hands on) is taken by a "
                 "make_forward(..., record_routing=True) forward only; build it so, or drop recorded_routing")


def _handed(out) -> tuple:
    """What a stage hands on so far, as a tuple: ``(hidden,)`` or ``(hidden, *carried)``."""
    return out if isinstance(out, tuple) else (out,)


def _check_stage_record(facts, carried) -> None:
    """A ``record_routing=True`` forward: ``carried`` (``recorded_routing``) is given exactly when the model is a
    later pipeline stage; else a ValueError naming the fix."""
    if facts.pre_process and carried is not None:
        raise ValueError("recorded_routing= given to the first pipeline stage (or a whole model): no earlier stage "
                         "recorded anything; drop recorded_routing")
    if not facts.pre_process and carried is None:
        raise ValueError("record_routing=True on a later pipeline stage needs the earlier stages' record: pass "
                         "recorded_routing= the previous stage's output[1] (its forward returns (hidden, record, "
                         "...)); run_micro_batches(..., pp_group=...) hands it on")


def _routers(model) -> list:
    from ..models.mlp.moe import routers

    gpt = unwrap(model)
    return routers(getattr(gpt, "decoder", gpt))


def _batch_rows(step) -> int:
    """``b`` of the model's hidden states ``[s, b, h]``: the packed ids' rows (THD: 1)."""
    return 1 if step.ids is None else step.ids.shape[0]


def _sp(model) -> tuple[int, int, object]:
    """``(tp size, tp rank, group)`` of the model's sequence-parallel split (1, 0, None without one)."""
    gpt = unwrap(model)
    group = getattr(getattr(gpt, "pg_collection", None), "tp", None)
    if not gpt.config.sequence_parallel or group is None or group.size() == 1:
        return 1, 0, None
    return group.size(), group.rank(), group


def _router_rows(packed: Tensor, step) -> Tensor:
    """``[t', ...]`` in the layout's token order -> the routers' rows: ``[s, b]`` order, this TP rank's share."""
    rows = seq_major(packed, _batch_rows(step))
    tp, rank, _ = _sp(step.model)
    n = rows.shape[0] // tp
    return rows[rank * n:(rank + 1) * n]


def _token_rows(rows: Tensor, step) -> Tensor:
    """The inverse of :func:`_router_rows`: every TP rank's share gathered, back to the token order."""
    tp, _, group = _sp(step.model)
    if tp > 1:
        parts = [torch.empty_like(rows) for _ in range(tp)]
        torch.distributed.all_gather(parts, rows.contiguous(), group=group)
        rows = torch.cat(parts)
    return seq_major(rows, _batch_rows(step), inverse=True)


def _moe_layers(given, found: list, config):
    """``routed_experts`` given for every decoder layer (``config.num_layers`` of them, the whole model's, as a
    rollout engine may record them): the rows of this model's (stage's) MoE layers, by layer number, the others
    dropped; anything else as given."""
    if not isinstance(given, Tensor) or given.dim() != 4 or given.shape[2] != config.num_layers \
            or len(found) == config.num_layers:
        return given
    index = torch.tensor([r.layer_number - 1 for r in found], device=given.device)
    if given.is_nested:
        return torch.nested.nested_tensor_from_jagged(given.values().index_select(1, index), given.offsets())
    return given.index_select(2, index)


def _check_replay_mask(mask, batch) -> None:
    """``replay_mask``: bool ``[b, s]`` like ``input_ids`` (jagged ``[b, j]`` like jagged ids, as many tokens)."""
    ids = batch.input_ids
    fix = "pass a bool tensor shaped like input_ids (jagged like jagged ids), True where routed_experts is replayed"
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        got = mask.dtype if isinstance(mask, Tensor) else type(mask).__name__
        raise TypeError(f"replay_mask must be a bool tensor, got {got}; {fix}")
    if ids is None or not ids.is_nested:
        source = batch.attention_mask if batch.plan is None else batch.plan.source.mask
        want = tuple((ids if ids is not None else source).shape[:2])
        if mask.is_nested or tuple(mask.shape) != want:
            shape = "jagged" if mask.is_nested else tuple(mask.shape)
            raise ValueError(f"replay_mask has shape {shape}; {fix}: {list(want)}")
    elif not mask.is_nested or mask.dim() != 2 or mask.shape[0] != ids.shape[0] \
            or mask.values().shape[0] != ids.values().shape[0]:
        shape = f"jagged with {mask.values().shape[0]} tokens" if mask.is_nested else tuple(mask.shape)
        raise ValueError(f"replay_mask has shape {shape}; {fix}: jagged [b={ids.shape[0]}, j] with "
                         f"{ids.values().shape[0]} tokens")


def _check_routed(given, batch, layers: int, config, replay_mask=None) -> None:
    """``routed_experts``: integer ``[b, s, L, k]`` (jagged ``[b, j, L, k]``) with, at every real token (that
    ``replay_mask`` replays, when given), ``k`` distinct experts in ``[0, E)``; eagerly on the CPU, with
    ``torch._assert_async`` on CUDA."""
    k, experts = config.moe_router_topk, config.num_moe_experts
    if not isinstance(given, Tensor) or given.dtype.is_floating_point or given.dtype == torch.bool:
        got = given.dtype if isinstance(given, Tensor) else type(given).__name__
        raise TypeError(f"routed_experts must be an integer tensor [b, s, {layers}, {k}] (expert ids), got {got}")
    ids = batch.input_ids
    want = (*ids.shape[:2], layers, k) if not ids.is_nested else None
    shape = tuple(given.shape) if not given.is_nested else (given.shape[0], None, *given.shape[2:])
    if (want is not None and shape != want) or (want is None and (not given.is_nested or shape[2:] != (layers, k))):
        raise ValueError(f"routed_experts has shape {shape}; pass [b, s, L, k] = "
                         f"{list(want) if want else ['b', 'j', layers, k]}: this model's {layers} MoE layers in layer "
                         f"order (or every one of its {config.num_layers} decoder layers, the dense ones' rows "
                         f"ignored), its top-{k} experts per token (jagged like input_ids for jagged ids)")
    if given.is_nested:  # every value is a real token's
        values = given.values()
        real = None if replay_mask is None else replay_mask.values().to(given.device)[..., None, None]
    else:  # no boolean indexing (a host sync): padding (and tokens not replayed) passes every check
        mask = batch.attention_mask if batch.plan is None else batch.plan.source.mask
        values = given
        real = None if mask is None else mask.to(device=given.device, dtype=torch.bool)
        if replay_mask is not None:
            replay = replay_mask.to(given.device)
            real = replay if real is None else real & replay
        real = None if real is None else real[..., None, None]
    if values.numel() == 0:
        return
    ordered = values.sort(-1).values
    in_range = (ordered[..., :1] >= 0) & (ordered[..., -1:] < experts)
    distinct = (ordered[..., 1:] != ordered[..., :-1]).all(-1, keepdim=True)
    if real is not None:
        in_range, distinct = in_range | ~real, distinct | ~real
    in_range, distinct = in_range.all(), distinct.all()
    fix = f"pass, at every real token that is replayed and MoE layer, {k} distinct expert ids in [0, {experts})"
    if values.device.type != "cpu":
        torch._assert_async(in_range & distinct, f"routed_experts: an expert id out of range or repeated; {fix}")
        return
    if not bool(in_range):
        at_real = values if real is None else values[real.expand_as(values)]
        raise ValueError(f"routed_experts holds expert ids in [{int(at_real.min())}, {int(at_real.max())}] at real "
                         f"tokens, outside [0, {experts}); {fix}")
    if not bool(distinct):
        raise ValueError(f"routed_experts repeats an expert within a token's {k} at a real token; {fix}")
