"""Recorded routing and router replay under combined parallelism, four gloo processes against one process.

Strategy.  The tiny float64 Qwen3-MoE of ``tests/test_parallel_families.py`` (four layers: MoE 0, dense 1, MoE 2
and 3; 4 experts, top-2), the ragged batch of ``tests/test_moe.py``.  The reference is the one process's forward
of the whole batch, ``make_forward(..., record_routing=True)`` with the log-probs processor: its record (``-1`` at
padding) and log-probs, free and while replaying another record (the routing of the same model after a router
update, which moves tokens) with a mixed ``replay_mask``.  Every rank's record must equal it bit for bit and its
log-probs to float64 round-off (measured: at most 2.2e-15; asserted: 1e-12).  The masked replay's record differs from both
the free record and the routes given, and its log-probs from the free ones, so a replay or a mask that was dropped
or misapplied on some rank fails the comparisons.  One ``run_local`` call of four ranks runs every case in a row
(each rank's start-up is most of the cost):

* PP=2 x TP=2 with sequence parallelism (ranks: TP fastest, then PP) through ``run_micro_batches(pp_group=...)``:
  the stages hand on ``(hidden, record, routing sums)`` (``moe_aux_loss=True`` too), the record gathered over the
  TP ranks' sequence shares, in THD (several micro-batches), THD aligned and BSHD; the replay takes the routes of
  every decoder layer (each stage its own MoE layers' rows).
* PP=2 x CP=2 the same way (THD, THD aligned; several micro-batches), and PP=2 x TP=2 + SP x CP=2 with the two
  stages in each process (eight ranks would be needed across processes): the record handed from stage to stage
  is this CP rank's zigzag share, every TP rank's gathered.
* EP=2 (two expert-parallel groups of two data-parallel ranks, each rank its own batch of its own shape) with a
  ``replay_mask`` per rank: every other token, whole sequences, all False (the free forward), all True, with
  garbage where a token is not replayed; each rank's record and log-probs equal the one process's on its batch.
"""

from __future__ import annotations

import copy
import functools

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.logits import log_probs_and_entropy
from packfwd.models import from_hf

from .test_moe import ragged_batch
from .test_parallel_families import moe_model
from .test_replay import run_stages, updated
from .test_replay_mask import mixed_mask, with_garbage

PIPELINE_LAYOUTS = {"pp2_tp2_sp": [("thd", {}), ("thd", {"seq_align": 8}), ("bshd", {})],
                    "pp2_cp2": [("thd", {}), ("thd", {"seq_align": 8})]}
ATOL = 1e-12


def every_layer(routed, hf):
    """``[b, s, L, k]`` (the MoE layers) -> ``[b, s, num_layers, k]``: a dense layer's row a placeholder (7s)."""
    rows = iter(routed.unbind(2))
    return torch.stack([torch.full_like(routed[:, :, 0], 7) if layer in hf.config.mlp_only_layers else next(rows)
                        for layer in range(hf.config.num_hidden_layers)], 2)


def labels_of(ids):
    return ids.roll(-1, 1)


def recording(data_format="thd", tp_group=None, **layout):
    return make_forward(data_format, record_routing=True, moe_aux_loss=True,
                        logits_processor=functools.partial(log_probs_and_entropy, tp_group=tp_group), **layout)


def ep_batches():
    """One batch per rank, each of its own shape, with its replay mask: every other token, whole sequences (0 and
    2), none, all."""
    out = []
    for seed, (rows, cols) in enumerate(((4, 9), (3, 7), (4, 9), (2, 9))):
        ids, mask = ragged_batch(seed=seed)
        ids, mask = ids[:rows, :cols], mask[:rows, :cols]
        whole = torch.arange(rows)[:, None] % 2 == 0  # sequences 0 and 2
        replay = (mixed_mask(mask), mask & whole, torch.zeros_like(mask), mask.clone())[seed]
        out.append((ids, mask, replay))
    return out


def _switch(**sizes):
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ensure_model_parallel(**sizes)
    return ps


def _worker(rank: int, world: int, hf, routes, replay, ep_routes):
    """Every case, in a row: {case: this rank's outputs (None where it holds no last stage)}."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    ids, mask = ragged_batch()
    labels, out = labels_of(ids), {}
    for name, tp, cp in (("pp2_tp2_sp", 2, 1), ("pp2_cp2", 1, 2)):
        ps = _switch(tp_size=tp, cp_size=cp, pp_size=2)
        stage = from_hf(hf, tp_size=tp, tp_rank=ps.get_tensor_model_parallel_rank(), sequence_parallel=tp > 1,
                        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=2)
        group = ps.get_pipeline_model_parallel_group()
        for data_format, layout in PIPELINE_LAYOUTS[name]:
            forward = recording(data_format, ps.get_tensor_model_parallel_group() if tp > 1 else None, tp_size=tp,
                                cp_size=cp, cp_rank=ps.get_context_parallel_rank(),
                                cp_group=ps.get_context_parallel_group() if cp > 1 else None, **layout)
            plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=40 if data_format == "bshd" else 16 // cp,
                                      **forward.layout.plan_args)
            free = run_micro_batches(forward, [stage], plan, ids, mask, dp_rank=0, pp_group=group, labels=labels)
            mixed = run_micro_batches(forward, [stage], plan, ids, mask, dp_rank=0, pp_group=group, labels=labels,
                                      routed_experts=routes, replay_mask=replay)
            out[name, data_format, str(layout)] = None if free is None else dict(
                micro_batches=plan.micro_batches[0], free=free.outputs, mixed=mixed.outputs,
                aux=free.moe_aux_loss)

    ps = _switch(tp_size=2, cp_size=2)  # both stages in this process, each TP x CP rank its share
    stages = [from_hf(hf, tp_size=2, tp_rank=ps.get_tensor_model_parallel_rank(), sequence_parallel=True,
                      pp_rank=r, pp_size=2) for r in range(2)]
    forward = recording(tp_group=ps.get_tensor_model_parallel_group(), tp_size=2, cp_size=2,
                        cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        free, handed = run_stages(forward, stages, ids, mask, labels=labels)
        mixed, _ = run_stages(forward, stages, ids, mask, labels=labels, routed_experts=routes, replay_mask=replay)
    out["pp2_tp2_sp_cp2"] = dict(free=free, mixed=mixed, handed=handed[0][0])

    ps = _switch(ep_size=2)
    model = from_hf(hf, ep_size=2, ep_rank=ps.get_expert_model_parallel_rank())
    ids, mask, replay = ep_batches()[rank]
    with torch.no_grad():
        out["ep2"] = recording()(model, ids, mask, labels=labels_of(ids), routed_experts=ep_routes[rank],
                                 replay_mask=replay)
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def four_ranks():
    """``(reference, ranks)``: the one process's outputs, and each of the four ranks' (:func:`_worker`)."""
    from packfwd.testing import run_local

    hf = moe_model(layers=4)
    other = updated(copy.deepcopy(hf))  # its routing moves tokens: the record to replay
    ids, mask = ragged_batch()
    replay = mixed_mask(mask)
    forward = recording()
    with torch.no_grad():
        routes = forward(from_hf(other), ids, mask, labels=labels_of(ids))["routed_experts"]
        reference = dict(model=from_hf(hf), free=forward(from_hf(hf), ids, mask, labels=labels_of(ids)),
                         mixed=forward(from_hf(hf), ids, mask, labels=labels_of(ids), routed_experts=routes,
                                       replay_mask=replay), routes=routes, ids=ids, mask=mask, replay=replay)
        ep_routes, ep = [], []
        for ep_ids, ep_mask, ep_replay in ep_batches():
            labels = labels_of(ep_ids)
            given = forward(from_hf(other), ep_ids, ep_mask, labels=labels)["routed_experts"]
            ep_routes.append(with_garbage(given, ep_mask, ep_replay))  # garbage where not replayed: ignored
            ep.append(dict(given=given, free=forward(from_hf(hf), ep_ids, ep_mask, labels=labels),
                           mixed=forward(from_hf(hf), ep_ids, ep_mask, labels=labels, routed_experts=ep_routes[-1],
                                         replay_mask=ep_replay)))
    reference["ep"] = ep
    ranks = run_local(_worker, 4, hf, every_layer(routes, hf), replay, ep_routes, backend="gloo", timeout=300)
    return reference, ranks


def micro_batched_aux_loss(want, micro_batches):
    """The one process's aux loss of a step of these micro-batches: each micro-batch's loss weighted by its real
    tokens (``run_micro_batches``' pooling; the loss of the whole batch at once is another number)."""
    mask, total = want["mask"], 0.0
    ids = want["ids"]
    with torch.no_grad():
        for rows in micro_batches:
            out = recording()(want["model"], ids[rows], mask[rows], labels=labels_of(ids[rows]))
            total = total + out["moe_aux_loss"] * mask[rows].sum()
    return total / mask.sum()


def assert_as_one_process(got, want, what):
    """The record bit for bit (-1 at padding), the log-probs to float64 round-off; free and masked replay."""
    mask = want["mask"]
    for run in ("free", "mixed"):
        record = got[run]["routed_experts"]
        assert torch.equal(record, want[run]["routed_experts"]), (what, run)
        assert (record[~mask] == -1).all() and (record[mask] >= 0).all(), (what, run)
        torch.testing.assert_close(got[run]["log_probs"], want[run]["log_probs"], atol=ATOL, rtol=0,
                                   msg=f"{what} {run}")


def test_reference_replay_moves_tokens_the_mask_keeps_some_free(four_ranks):
    """The negative control of the comparisons below: the masked replay's record differs from the free record and
    from the routes given, and its log-probs from the free ones."""
    want, _ = four_ranks
    mask, mixed, free = want["mask"], want["mixed"], want["free"]
    assert not torch.equal(mixed["routed_experts"], free["routed_experts"])
    assert not torch.equal(mixed["routed_experts"][mask], want["routes"][mask])
    assert (mixed["log_probs"] - free["log_probs"]).abs().max() > 1e-3


@pytest.mark.parametrize("data_format, layout", PIPELINE_LAYOUTS["pp2_tp2_sp"])
def test_pp2_tp2_sp_records_every_stage_over_gloo(four_ranks, data_format, layout):
    """PP=2 x TP=2 with sequence parallelism through ``run_micro_batches(pp_group=...)``: the last stage's record
    (every stage's MoE layers, each stage's gathered over its TP ranks) and log-probs are the one process's, free
    and under a masked replay of every decoder layer's routes; the aux loss pools both stages."""
    want, ranks = four_ranks
    key = ("pp2_tp2_sp", data_format, str(layout))
    assert [r[key] is None for r in ranks] == [True, True, False, False]  # ranks 2, 3: the last stage
    for r in ranks[2:]:
        assert len(r[key]["micro_batches"]) == (1 if data_format == "bshd" else 2 + bool(layout))
        assert_as_one_process(r[key], want, key)
        torch.testing.assert_close(r[key]["aux"], micro_batched_aux_loss(want, r[key]["micro_batches"]), atol=ATOL,
                                   rtol=0)


@pytest.mark.parametrize("data_format, layout", PIPELINE_LAYOUTS["pp2_cp2"])
def test_pp2_cp2_records_every_stage_over_gloo(four_ranks, data_format, layout):
    """PP=2 x CP=2 through ``run_micro_batches(pp_group=...)``: the last stage's record (each CP rank's zigzag
    share handed on, the shares gathered) and log-probs are the one process's, free and under a masked replay."""
    want, ranks = four_ranks
    key = ("pp2_cp2", data_format, str(layout))
    assert [r[key] is None for r in ranks] == [True, True, False, False]  # ranks 2, 3: the last stage
    for r in ranks[2:]:
        assert len(r[key]["micro_batches"]) > 1
        assert_as_one_process(r[key], want, key)
        torch.testing.assert_close(r[key]["aux"], micro_batched_aux_loss(want, r[key]["micro_batches"]), atol=ATOL,
                                   rtol=0)


def test_two_stages_under_tp2_sp_and_cp2_record_the_whole_model(four_ranks):
    """PP=2 (both stages in each process) x TP=2 + SP x CP=2: stage 0 hands on its CP rank's share of the
    packed tokens (every TP rank's gathered, stage 0's one MoE layer, ``-1`` at the pads), and every rank's last
    stage gives the one process's record and log-probs, free and under a masked replay."""
    want, ranks = four_ranks
    shares = [r["pp2_tp2_sp_cp2"]["handed"] for r in ranks]
    assert all(h.shape[1:] == (1, 2) for h in shares)
    assert torch.equal(shares[0], shares[1]) and torch.equal(shares[2], shares[3])  # each TP pair: its CP share whole
    assert sum(int((h[:, 0, 0] >= 0).sum()) for h in shares[::2]) == int(want["mask"].sum())  # CP ranks 0, 1
    for r in ranks:
        assert_as_one_process(r["pp2_tp2_sp_cp2"], want, "pp2_tp2_sp_cp2")


def test_ep2_replays_by_the_mask_over_gloo(four_ranks):
    """EP=2, each rank its own batch and mask (every other token, whole sequences, none, all; garbage where not
    replayed): each rank's record, the experts it used, and its log-probs are the one process's on its batch."""
    want, ranks = four_ranks
    for rank, (r, ref, (ids, mask, replay)) in enumerate(zip(ranks, want["ep"], ep_batches())):
        got = r["ep2"]
        assert torch.equal(got["routed_experts"], ref["mixed"]["routed_experts"]), rank
        assert (got["routed_experts"][~mask] == -1).all()
        torch.testing.assert_close(got["log_probs"], ref["mixed"]["log_probs"], atol=ATOL, rtol=0)
        used, free, given = got["routed_experts"], ref["free"]["routed_experts"], ref["given"]
        assert torch.equal(used[replay], given[replay]), rank  # a replayed token: the given experts
        if rank == 2:  # replay nothing: the free forward
            assert torch.equal(used, free)
        else:  # the given routes move some tokens; a mixed mask leaves others to the router
            assert not torch.equal(used, free), rank
            assert torch.equal(used[mask], given[mask]) == (rank == 3), rank
