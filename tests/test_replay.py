"""Router replay and recorded routing: ``make_forward(record_routing=True)`` and the forward's ``routed_experts=``.

Strategy.  transformers is the oracle, run one sequence at a time.  Recording: each real token's recorded experts
are transformers' own top-k of that sequence alone (as sets; -1 at padding), in THD, THD aligned, BSHD and jagged.
Replay: the router weights are then changed (an "update"), which moves some tokens to other experts; the replayed
forward's logits equal transformers run per sequence with its router forced to the recorded experts (its weights
computed as the family computes them for its own choice), in THD and BSHD, with garbage at padding.  The aux loss
under replay equals a hand computation of transformers' formula on the replayed assignments.  Bad input is refused
naming ``routed_experts``.  Families: Mixtral (softmax, top-k renormalised) and Qwen3-MoE without renormalisation;
GPT-OSS (softmax over the top-k biased logits), Qwen3-Next and Qwen3.5-MoE (hybrid linear attention, a gated shared
expert) in one test of their own: record, update, replay in THD, THD aligned and BSHD, log-probs and entropies
against transformers forced per sequence.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.logits import log_probs_and_entropy
from packfwd.models import from_hf

from .test_moe import hf_model, ragged_batch

LAYOUTS = [("thd", {}), ("thd", {"seq_align": 8}), ("bshd", {})]
NAMES = ["mixtral", "qwen3_moe-unnormalised-step2"]


def hf_moe_blocks(hf):
    return [layer.mlp for layer in hf.model.layers if hasattr(layer.mlp, "gate")]


def hf_routers(hf):
    """transformers' MoE routers in layer order: ``mlp.gate`` (Mixtral, Qwen3-MoE, Qwen3-Next, Qwen3.5-MoE) or
    ``mlp.router`` (GPT-OSS); a dense layer has neither (Qwen3-Next's dense MLP has a ``gate_proj``)."""
    found = (getattr(layer.mlp, "router", None) or getattr(layer.mlp, "gate", None) for layer in hf.model.layers)
    return [r for r in found if hasattr(r, "top_k")]


def hf_topk(hf, ids, mask):
    """transformers' own top-k per real token, sequence by sequence: ``[b, s, L, k]`` (-1 at padding)."""
    routers = hf_routers(hf)
    k = hf.config.num_experts_per_tok
    out = torch.full((*ids.shape, len(routers), k), -1)
    for i in range(ids.shape[0]):
        if not mask[i].any():
            continue
        picked = []
        hooks = [r.register_forward_hook(lambda m, a, o: picked.append(o[2])) for r in routers]
        try:
            with torch.no_grad():
                hf(ids[i][mask[i]][None])
        finally:
            for h in hooks:
                h.remove()
        out[i, mask[i]] = torch.stack(picked, 1)
    return out


@contextlib.contextmanager
def forced_routers(hf, routed_row, replay_row=None, used=None):
    """transformers' MoE routers forced to ``routed_row [n, L, k]`` (one sequence's real tokens): the family's
    weights for them (softmax over all experts gathered, renormalised over the k when the family does).  With
    ``replay_row [n]`` only where it is True, elsewhere transformers' own top-k of this run's router logits;
    ``used``: a list that gets each layer's ``(router logits, experts chosen)``."""
    blocks = hf_moe_blocks(hf)
    normalise = getattr(hf.config, "norm_topk_prob", True)  # Mixtral always renormalises
    saved = [b.gate.forward for b in blocks]
    for layer, b in enumerate(blocks):
        def forced(hidden, gate=b.gate, idx=routed_row[:, layer]):
            hidden = hidden.reshape(-1, gate.weight.shape[1])
            logits = torch.nn.functional.linear(hidden, gate.weight)
            probs = torch.softmax(logits.float(), dim=-1)
            if replay_row is not None:
                idx = torch.where(replay_row[:, None], idx, probs.topk(idx.shape[1], dim=-1).indices)
            if used is not None:
                used.append((logits, idx))
            probs = probs.gather(1, idx)
            if normalise:
                probs = probs / probs.sum(-1, keepdim=True)
            return logits, probs.to(logits.dtype), idx
        b.gate.forward = forced
    try:
        yield
    finally:
        for b, f in zip(blocks, saved):
            b.gate.forward = f


def hf_forced(hf, ids, mask, routed):
    """transformers' logits per sequence with its routers forced to ``routed`` (:func:`forced_routers`)."""
    out = torch.zeros(*ids.shape, hf.config.vocab_size, dtype=torch.float64)
    for i in range(ids.shape[0]):
        if mask[i].any():
            with forced_routers(hf, routed[i][mask[i]]):
                out[i, mask[i]] = hf(ids[i][mask[i]][None]).logits[0].double()
    return out


def updated(hf, scale=3.0, seed=1):
    """The same model after an "update" of its routers (large enough to move tokens to other experts)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for r in hf_routers(hf):
            r.weight.add_(scale * torch.randn(r.weight.shape, generator=g, dtype=r.weight.dtype))
    return hf


def as_sets(r):
    return r.sort(-1).values


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("data_format, layout", LAYOUTS)
def test_recorded_routing_is_transformers_topk(name, data_format, layout):
    hf = hf_model(name)
    model = from_hf(hf)
    ids, mask = ragged_batch()
    with torch.no_grad():
        got = make_forward(data_format, record_routing=True, **layout)(model, ids, mask)["routed_experts"]
    want = hf_topk(hf, ids, mask)
    assert got.dtype == torch.int64 and got.shape == want.shape
    assert (got[~mask] == -1).all()
    assert torch.equal(as_sets(got[mask]), as_sets(want[mask]))


def test_recorded_routing_jagged_in_jagged_out():
    hf = hf_model("mixtral")
    model = from_hf(hf)
    ids, mask = ragged_batch()
    nested = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)], layout=torch.jagged)
    with torch.no_grad():
        got = make_forward("thd", record_routing=True)(model, nested)["routed_experts"]
    assert got.is_nested and torch.equal(got.offsets(), nested.offsets())
    assert torch.equal(as_sets(got.values()), as_sets(hf_topk(hf, ids, mask)[mask]))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("data_format, layout", LAYOUTS)
def test_replay_after_an_update_equals_transformers_forced(name, data_format, layout):
    hf = hf_model(name)
    ids, mask = ragged_batch()
    forward = make_forward(data_format, record_routing=True, **layout)
    with torch.no_grad():
        recorded = forward(from_hf(hf), ids, mask)["routed_experts"]
    hf = updated(hf)
    model = from_hf(hf)
    with torch.no_grad():
        free = forward(model, ids, mask)["routed_experts"]
        assert not torch.equal(as_sets(free[mask]), as_sets(recorded[mask]))  # the update moved some tokens
        garbage = recorded.masked_fill(~mask[..., None, None], 99)  # padding values are ignored, whatever they are
        out = forward(model, ids, mask, routed_experts=garbage.to(torch.int32))
    assert torch.equal(out["routed_experts"], recorded)  # recording while replaying returns the replayed experts
    want = hf_forced(hf, ids, mask, recorded)
    torch.testing.assert_close(out["logits"][mask].double(), want[mask], atol=1e-5, rtol=1e-5)
    assert not out["logits"][~mask].any()


FAMILIES = ["gpt_oss", "qwen3_next", "qwen3_5_moe"]  # router replay of the families beyond Mixtral and Qwen3-MoE


def family_model(family, monkeypatch):
    """The tiny float64 model of ``family`` that its own tests build: GPT-OSS's of ``tests/test_gpt_oss.py`` (3
    MoE layers with router biases, sliding window 4, sinks, YaRN; its RMSNorm patched to compute in float64),
    Qwen3-Next's and Qwen3.5-MoE's of ``tests/test_hybrid_families.py`` (Gated DeltaNet and gated attention, a
    gated shared expert; Qwen3-Next's layer 1 dense; transformers' modules lifted to float64).  So transformers is
    float64 throughout and the float32 left is packfwd's routing softmax (Megatron-Core's)."""
    if family == "gpt_oss":
        from .oracles import rmsnorm_in_input_dtype
        from .test_gpt_oss import gpt_oss, oss_model

        monkeypatch.setattr(gpt_oss.GptOssRMSNorm, "forward", rmsnorm_in_input_dtype)
        return oss_model()
    from .test_hybrid_families import hf_model as hybrid_model

    return hybrid_model(family)


@contextlib.contextmanager
def family_forced_routers(hf, routed_row):
    """transformers' routers forced to ``routed_row [n, L, k]`` (one sequence's real tokens), each expert weighted
    as the family weights its own choice, in the model's dtype: GPT-OSS (``mlp.router``, biased logits) the softmax
    over the k given experts' logits; Qwen3-Next and Qwen3.5-MoE (``mlp.gate``) the softmax over all experts at
    the given ones, renormalised over the k (Qwen3-Next as ``norm_topk_prob`` says, Qwen3.5-MoE always)."""
    routers = hf_routers(hf)
    saved = [r.forward for r in routers]
    for layer, r in enumerate(routers):
        def forced(hidden, r=r, idx=routed_row[:, layer]):
            logits = torch.nn.functional.linear(hidden.reshape(-1, r.weight.shape[1]), r.weight,
                                                getattr(r, "bias", None))
            if hasattr(r, "bias"):  # GPT-OSS: softmax over the top-k logits
                weights = torch.softmax(logits.gather(1, idx), dim=1)
            else:
                weights = torch.softmax(logits, dim=-1).gather(1, idx)
                if getattr(r, "norm_topk_prob", True):  # Qwen3.5-MoE's router has no flag: it always renormalises
                    weights = weights / weights.sum(-1, keepdim=True)
            return logits, weights, idx
        r.forward = forced
    try:
        yield
    finally:
        for r, f in zip(routers, saved):
            r.forward = f


def hf_forced_scores(hf, ids, mask, labels, routed):
    """transformers run one sequence at a time with its routers forced to ``routed``
    (:func:`family_forced_routers`): ``(log-prob of each label [b, s], 0 where ignored; entropy [b, s] at every
    real token)``, float64."""
    log_probs = torch.zeros(ids.shape, dtype=torch.float64)
    entropy = torch.zeros(ids.shape, dtype=torch.float64)
    for i in range(ids.shape[0]):
        if not mask[i].any():
            continue
        with torch.no_grad(), family_forced_routers(hf, routed[i][mask[i]]):
            logp = hf(ids[i][mask[i]][None]).logits[0].double().log_softmax(-1)
        label = labels[i][mask[i]]
        log_probs[i, mask[i]] = torch.where(label >= 0, logp.gather(1, label.clamp(min=0)[:, None])[:, 0], 0.0)
        entropy[i, mask[i]] = -(logp.exp() * logp).sum(-1)
    return log_probs, entropy


@pytest.mark.parametrize("family", FAMILIES)
def test_replay_of_gpt_oss_qwen3_next_and_qwen3_5_moe_equals_transformers_forced(family, monkeypatch):
    """GPT-OSS, Qwen3-Next and Qwen3.5-MoE on the ragged batch (left and right padding, a one-token row): the record
    is transformers' own top-k (as sets; -1 at padding), and replaying it on the same model gives the recording
    forward's outputs bit for bit.  After a router update that moves tokens, the replay (THD, THD aligned, BSHD)
    returns the recorded experts and its log-probs (and entropies, the one-token row's included) equal
    transformers run per sequence with its routers forced to them; the free forward's do not.

    Tolerance 1e-5: the reference is float64 throughout, packfwd takes the routing softmax in float32
    (Megatron-Core's), so each expert weight carries a float32 rounding (~6e-8 relative) that the following layers
    carry to the log-probs (no other float32 is left: :func:`family_model`).  Measured: at most
    8.3e-8 (GPT-OSS), 3.5e-7 (Qwen3-Next), 2.9e-7 (Qwen3.5-MoE) in log-probs, 2.6e-8 / 2.0e-7 / 1.7e-7 in entropy;
    the update moves 37 of 63, 55 of 63 and 68 of 84 token-layer choices, and the free routing's log-probs are off
    by 0.9, 2.3 and 2.8."""
    hf = family_model(family, monkeypatch)
    ids, mask = ragged_batch()
    labels = next_token_labels(ids, mask)
    scored = labels >= 0
    record = make_forward("thd", record_routing=True, logits_processor=log_probs_and_entropy, scored_only=False)
    model = from_hf(hf)
    with torch.no_grad():
        recorded = record(model, ids, mask, labels=labels)
        again = record(model, ids, mask, labels=labels, routed_experts=recorded["routed_experts"])
    assert all(torch.equal(again[key], value) for key, value in recorded.items())  # record then replay: same bits
    routed = recorded["routed_experts"]
    assert routed.shape == (*ids.shape, len(hf_routers(hf)), 2) and (routed[~mask] == -1).all()
    assert torch.equal(as_sets(routed[mask]), as_sets(hf_topk(hf, ids, mask)[mask]))
    hf = updated(hf)
    model = from_hf(hf)
    want_log_probs, want_entropy = hf_forced_scores(hf, ids, mask, labels, routed)
    for data_format, layout in LAYOUTS:
        forward = make_forward(data_format, record_routing=True, logits_processor=log_probs_and_entropy,
                               scored_only=False, **layout)
        with torch.no_grad():
            out = forward(model, ids, mask, labels=labels, routed_experts=routed)
            free = forward(model, ids, mask, labels=labels)
        where = f"{family} {data_format} {layout}"
        assert torch.equal(out["routed_experts"], routed), where  # the replayed experts are the recorded ones
        torch.testing.assert_close(out["log_probs"][scored], want_log_probs[scored], atol=1e-5, rtol=0, msg=where)
        torch.testing.assert_close(out["entropy"][mask], want_entropy[mask], atol=1e-5, rtol=0, msg=where)
        assert not out["log_probs"][~scored].any() and not out["entropy"][~mask].any(), where
        assert not torch.equal(as_sets(free["routed_experts"][mask]), as_sets(routed[mask])), where  # tokens moved
        assert (free["log_probs"] - want_log_probs)[scored].abs().max() > 1e-2, where  # without replay: other values


def test_replay_gives_the_router_its_gradient():
    """The router learns through the replayed experts' weights: its gradient is nonzero and equals the gradient
    through transformers' forced routing."""
    hf = hf_model("mixtral")
    ids, mask = ragged_batch()
    with torch.no_grad():
        recorded = make_forward("thd", record_routing=True)(from_hf(hf), ids, mask)["routed_experts"]
    hf = updated(hf)
    model = from_hf(hf)
    weights = torch.randn(*ids.shape, hf.config.vocab_size, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    logits = make_forward("thd")(model, ids, mask, routed_experts=recorded)
    (logits.double() * weights)[mask].sum().backward()
    blocks = hf_moe_blocks(hf)
    for b in blocks:
        b.gate.weight.grad = None
    (hf_forced(hf, ids, mask, recorded) * weights)[mask].sum().backward()
    routers = [m for m in model.modules() if type(m).__name__ == "PackedRouter"]
    assert len(routers) == len(blocks)
    for r, b in zip(routers, blocks):
        assert r.weight.grad.abs().sum() > 0
        torch.testing.assert_close(r.weight.grad.double(), b.gate.weight.grad.double(), atol=5e-5, rtol=1e-4)  # float32


def test_aux_loss_under_replay_is_the_hand_computation():
    """``moe_aux_loss`` with ``routed_experts``: transformers' formula (its ``load_balancing_loss_func``) on the
    replayed assignments against the current probabilities, over the real tokens."""
    hf = hf_model("mixtral")
    ids, mask = ragged_batch()
    with torch.no_grad():
        recorded = make_forward("thd", record_routing=True)(from_hf(hf), ids, mask)["routed_experts"]
    hf = updated(hf)
    model = from_hf(hf)
    with torch.no_grad():
        got = make_forward("thd", moe_aux_loss=True)(model, ids, mask, routed_experts=recorded)["moe_aux_loss"]
        logits = []  # every MoE layer's router logits of the real tokens, transformers' forced forward
        blocks = hf_moe_blocks(hf)
        hooks = [b.gate.register_forward_hook(lambda m, a, o: logits.append(o[0])) for b in blocks]
        try:
            hf_forced(hf, ids, mask, recorded)
        finally:
            for h in hooks:
                h.remove()
    layers, experts = len(blocks), hf.config.num_local_experts
    per_layer = [torch.cat([logits[i * layers + l] for i in range(len(logits) // layers)]) for l in range(layers)]
    probs = torch.cat([torch.softmax(x.double(), -1) for x in per_layer])  # [layers * t, E]
    chosen = torch.cat([recorded[mask][:, l] for l in range(layers)])  # [layers * t, k]
    one_hot = torch.nn.functional.one_hot(chosen, experts).double()  # [layers * t, k, E]
    want = (one_hot.mean(0) * probs.mean(0)[None]).sum() * experts
    torch.testing.assert_close(got.double(), want, atol=1e-6, rtol=1e-6)  # float32 model
    with torch.no_grad():  # control: the free routing's loss (what it would be without replay) is another number
        free = make_forward("thd", moe_aux_loss=True)(model, ids, mask)["moe_aux_loss"]
    assert abs(float(free) - float(want)) > 1e-4


def test_bad_routed_experts_name_the_argument():
    hf = hf_model("mixtral")
    model = from_hf(hf)
    ids, mask = ragged_batch()
    forward = make_forward("thd")
    with torch.no_grad():
        good = make_forward("thd", record_routing=True)(model, ids, mask)["routed_experts"]
    layers, k = good.shape[-2:]
    with pytest.raises(ValueError, match=r"routed_experts has shape .* pass \[b, s, L, k\]"):
        forward(model, ids, mask, routed_experts=good[..., :1, :])
    with pytest.raises(TypeError, match="routed_experts must be an integer tensor"):
        forward(model, ids, mask, routed_experts=good.float())
    bad = good.clone()
    bad[0, 0, 0, 0] = 4  # 4 experts: ids in [0, 4)
    with pytest.raises(ValueError, match=r"routed_experts holds expert ids .* outside \[0, 4\)"):
        forward(model, ids, mask, routed_experts=bad)
    bad = good.clone()
    bad[0, 0, 0, 1] = bad[0, 0, 0, 0]
    with pytest.raises(ValueError, match="routed_experts repeats an expert"):
        forward(model, ids, mask, routed_experts=bad)
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from .test_moe import TINY, randomise

    dense = from_hf(randomise(Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY, intermediate_size=48, num_experts=4,
                                                                   mlp_only_layers=[0, 1, 2]))))
    with pytest.raises(ValueError, match="routed_experts= on a model .* without MoE layers"):
        forward(dense, ids, mask, routed_experts=good)
    with pytest.raises(ValueError, match="record_routing=True on a model .* without MoE layers"):
        make_forward("thd", record_routing=True)(dense, ids, mask)


def test_the_routing_flags_must_be_bools():
    """``record_routing``, ``moe_aux_loss``, ``mtp`` and ``vision`` are flags, checked when the forward is built,
    naming themselves: ``moe_aux_loss=2`` built two aux-loss extensions and failed at the call ("routing_stats is
    already open"), a string or None failed with "can't multiply sequence by non-int", and ``vision="false"`` turned
    the vision call on."""
    for name in ("record_routing", "moe_aux_loss", "mtp", "vision"):
        for value in (2, "false", None):
            with pytest.raises(TypeError, match=f"{name} must be a bool, got {type(value).__name__}"):
                make_forward("thd", **{name: value})


def _parallel_worker(rank: int, world: int, hf, layouts, recorded, update, replay_mask):
    """Per layout ``(name, tp, cp)`` (TP with sequence parallelism): this rank's recording of the model, its
    replay of ``recorded`` on the updated model (``update``: the updated state dict), and that replay with
    ``replay_mask`` (its record and logits)."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ids, mask = ragged_batch()
    original = {k: v.clone() for k, v in hf.state_dict().items()}
    results = {}
    for name, tp, cp in layouts:
        hf.load_state_dict(original)
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ensure_model_parallel(tp_size=tp, cp_size=cp)
        tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
        forward = make_forward("thd", tp_size=tp, cp_size=cp, cp_rank=cp_rank, record_routing=True,
                               cp_group=ps.get_context_parallel_group() if cp > 1 else None)
        with torch.no_grad():
            record = forward(from_hf(hf, tp_size=tp, tp_rank=tp_rank, sequence_parallel=tp > 1), ids, mask)
            hf.load_state_dict(update)
            model = from_hf(hf, tp_size=tp, tp_rank=tp_rank, sequence_parallel=tp > 1)
            replay = forward(model, ids, mask, routed_experts=recorded)
            masked = forward(model, ids, mask, routed_experts=recorded, replay_mask=replay_mask)
        results[name] = dict(record=record["routed_experts"], replay=replay["routed_experts"],
                             logits=replay["logits"], masked=masked)
    ps.destroy_model_parallel()
    return results


def test_tp2_sp_and_cp2_over_gloo_equal_one_process():
    """Sequence-parallel TP=2 (each rank routes its half of the tokens) and CP=2 (each rank its zigzag share):
    every rank's record is the one process's, and replaying it on the updated model gives its logits; so does a
    replay with a ``replay_mask`` (the mask split with the routes: its record and logits are the one process's)."""
    import copy

    from packfwd.testing import run_local

    hf = hf_model("mixtral")
    ids, mask = ragged_batch()
    replay_mask = mask & (torch.arange(mask.shape[1]) % 2 == 0)
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        recorded = forward(from_hf(hf), ids, mask)["routed_experts"]
        new = updated(copy.deepcopy(hf))
        want = forward(from_hf(new), ids, mask, routed_experts=recorded)["logits"]
        masked = forward(from_hf(new), ids, mask, routed_experts=recorded, replay_mask=replay_mask)
    assert not torch.equal(masked["routed_experts"], recorded)  # the mask left some moved tokens to the router
    ranks = run_local(_parallel_worker, 2, hf, [("tp2_sp", 2, 1), ("cp2", 1, 2)], recorded, new.state_dict(),
                      replay_mask, backend="gloo", timeout=300)
    for layout in ("tp2_sp", "cp2"):
        for r in ranks:
            assert torch.equal(r[layout]["record"], recorded), layout
            assert torch.equal(r[layout]["replay"], recorded), layout
            assert torch.equal(r[layout]["masked"]["routed_experts"], masked["routed_experts"]), layout
    torch.testing.assert_close(torch.cat([r["tp2_sp"]["logits"] for r in ranks], -1), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat([r["tp2_sp"]["masked"]["logits"] for r in ranks], -1), masked["logits"],
                               atol=1e-5, rtol=1e-5)
    for r in ranks:
        torch.testing.assert_close(r["cp2"]["logits"], want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(r["cp2"]["masked"]["logits"], masked["logits"], atol=1e-5, rtol=1e-5)


def test_micro_batches_slice_the_routing_like_every_per_token_input():
    """``run_micro_batches(..., routed_experts=R)``: each micro-batch replays its rows of ``R`` (cut like every
    per-token argument), and a recording forward's record comes back in the caller's row order: the whole batch's."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    hf = hf_model("mixtral")
    ids, mask = ragged_batch()
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        recorded = forward(from_hf(hf), ids, mask)["routed_experts"]
        model = from_hf(updated(hf))
        want = forward(model, ids, mask, routed_experts=recorded)
        plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=12, **forward.layout.plan_args)
        assert sum(len(mb) > 0 for mb in plan.micro_batches[0]) > 1  # several micro-batches
        got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, routed_experts=recorded)
    assert got.rows == list(range(ids.shape[0]))
    assert torch.equal(got.outputs["routed_experts"], recorded)
    torch.testing.assert_close(got.outputs["logits"], want["logits"], atol=1e-6, rtol=1e-6)


def test_pipeline_stages_replay_their_own_layers():
    """Two pipeline stages in one process: each stage replays its own MoE layers' share of the record (stage 0
    the first, stage 1 the rest) and the last stage's logits are the whole model's replay."""
    from .test_parallel_families import moe_model

    hf = moe_model(layers=4)  # Qwen3-MoE, layer 1 dense: stage 0 routes at layer 0, stage 1 at layers 2 and 3
    ids, mask = ragged_batch()
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        recorded = forward(from_hf(hf), ids, mask)["routed_experts"]
        hf = updated(hf)
        want = make_forward("thd")(from_hf(hf), ids, mask, routed_experts=recorded)
        stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
        split = sum(1 for m in stages[0].modules() if type(m).__name__ == "PackedRouter")
        assert 0 < split < recorded.shape[2]
        plain = make_forward("thd")
        hidden = plain(stages[0], ids, mask, routed_experts=recorded[:, :, :split])
        stages[1].set_input_tensor(hidden)
        got = plain(stages[1], ids, mask, routed_experts=recorded[:, :, split:])
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
        with pytest.raises(ValueError, match="routed_experts has shape"):  # the whole record on one stage
            plain(stages[0], ids, mask, routed_experts=recorded)


def run_stages(forward, stages, ids, mask, **kwargs):
    """``stages`` in one process, each handing on ``(hidden, *carried)`` to the next (``forward.carried`` names
    the keywords): the last stage's outputs, and what each earlier stage handed on."""
    carried, handed, hidden = {}, [], None
    for i, stage in enumerate(stages):
        if i:
            stage.set_input_tensor(hidden)
        out = forward(stage, ids, mask, **kwargs, **carried)
        if i < len(stages) - 1:
            hidden, *rest = out
            handed.append(rest)
            carried = dict(zip(forward.carried, rest))
    return out, handed


@pytest.mark.parametrize("data_format, layout", [("thd", {}), ("thd", {"seq_align": 8}), ("bshd", {})])
def test_pipeline_stages_record_the_whole_models_routing(data_format, layout):
    """``record_routing=True`` on pipeline stages: each stage hands on the record so far (every earlier stage's MoE
    layers and its own, packed, ``-1`` at the layout's pads) and the last stage's ``"routed_experts"`` is the whole
    model's record bit for bit (-1 at padding), on two stages (MoE layer 0 | 2, 3) and on three (0 | dense 1 | 2:
    the middle stage hands the record on unchanged); with ``moe_aux_loss`` a stage hands on ``(hidden, record,
    sums)``; an empty batch records nothing."""
    from .test_parallel_families import moe_model

    ids, mask = ragged_batch()
    forward = make_forward(data_format, record_routing=True, **layout)
    assert forward.carried == ("recorded_routing",)
    with torch.no_grad():
        for layers, pp in ((4, 2), (3, 3)):
            hf = moe_model(layers=layers)
            want = forward(from_hf(hf), ids, mask)
            stages = [from_hf(hf, pp_rank=r, pp_size=pp) for r in range(pp)]
            got, handed = run_stages(forward, stages, ids, mask)
            assert torch.equal(got["routed_experts"], want["routed_experts"]), (layers, pp)
            assert (got["routed_experts"][~mask] == -1).all() and (got["routed_experts"][mask] >= 0).all()
            assert torch.equal(got["logits"], want["logits"])
            own = [sum(type(m).__name__ == "PackedRouter" for m in s.modules()) for s in stages[:-1]]
            for (record,), so_far in zip(handed, torch.tensor(own).cumsum(0).tolist()):
                assert record.dtype == torch.int64 and record.shape[1:] == (so_far, 2)
            if pp == 3:
                assert own[1] == 0 and torch.equal(handed[0][0], handed[1][0])  # the dense stage: unchanged
        both = make_forward(data_format, record_routing=True, moe_aux_loss=True, **layout)
        assert both.carried == ("recorded_routing", "moe_routing")
        got, handed = run_stages(both, stages, ids, mask)
        assert torch.equal(got["routed_experts"], want["routed_experts"])
        assert handed[0][0].dtype == torch.int64 and handed[0][1].dtype == torch.float64  # (hidden, record, sums)
        torch.testing.assert_close(got["moe_aux_loss"], both(from_hf(hf), ids, mask)["moe_aux_loss"])
        empty = torch.zeros_like(mask)
        got, handed = run_stages(forward, stages, ids, empty)
        assert torch.equal(got["routed_experts"], forward(from_hf(hf), ids, empty)["routed_experts"])
        assert (got["routed_experts"] == -1).all()


def test_a_carried_record_is_checked_against_the_batch():
    """``recorded_routing=`` is refused naming it: another micro-batch's record (other packed tokens, or as many
    with the padding elsewhere), another top-k, a float tensor; on the first stage; missing on a later stage of a
    recording forward; given to a forward that does not record."""
    from .test_parallel_families import moe_model

    hf = moe_model(layers=4)
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    ids, mask = ragged_batch()
    fewer = mask.clone()
    fewer[2] = False  # another micro-batch: fewer real tokens (the widest row kept: BSHD packs as many slots)
    moved = mask.clone()  # as many tokens, one moved from row 3 to row 2 (widest row unchanged): pads elsewhere
    moved[3, 5], moved[2, 4] = False, True
    assert moved.sum() == mask.sum() and mask[3, 5] and not mask[2, 4]
    padding = "recorded_routing has -1 .padding. elsewhere than this batch's padding"
    for data_format, layout, other, error in (("thd", {}, fewer, "recorded_routing has shape"),
                                              ("bshd", {}, fewer, padding), ("bshd", {}, moved, padding),
                                              ("thd", {"seq_align": 8}, moved, padding),
                                              ("thd", {}, moved, None)):  # no pad packed: its record fits
        forward = make_forward(data_format, record_routing=True, **layout)
        with torch.no_grad():
            hidden, record = forward(stages[0], ids, mask)
            _, theirs = forward(stages[0], ids, other)
            stages[1].set_input_tensor(hidden)
            if error is None:
                forward(stages[1], ids, mask, recorded_routing=theirs)
                continue
            with pytest.raises(ValueError, match=error + ".* another micro-batch.*pass the previous pipeline stage"):
                forward(stages[1], ids, mask, recorded_routing=theirs)
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"recorded_routing has shape \(21, 1, 1\).*top-2"):
            forward(stages[1], ids, mask, recorded_routing=record[..., :1])
        with pytest.raises(TypeError, match="recorded_routing must be an integer tensor"):
            forward(stages[1], ids, mask, recorded_routing=record.float())
        with pytest.raises(ValueError, match="recorded_routing= given to the first pipeline stage"):
            forward(stages[0], ids, mask, recorded_routing=record)
        with pytest.raises(ValueError, match="later pipeline stage needs the earlier stages' record: pass "
                                             "recorded_routing="):
            forward(stages[1], ids, mask)
        with pytest.raises(TypeError, match=r"recorded_routing= .* is taken by a make_forward\(..., record_routing"):
            make_forward("thd")(stages[1], ids, mask, recorded_routing=record)
    from packfwd.forward.moe import CARRIED_ON_DEVICE  # CUDA checks with torch._assert_async: under 255 characters

    assert len(CARRIED_ON_DEVICE) < 255 and "recorded_routing" in CARRIED_ON_DEVICE


def _ep_worker(rank: int, world: int, hf, batches, records):
    """EP=2: this rank's batch (its own shape) recorded, then replayed with the one process's record."""
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(ep_size=2)
    model = from_hf(hf, ep_size=2, ep_rank=rank)
    ids, mask = batches[rank]
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        record = forward(model, ids, mask)["routed_experts"]
        replay = forward(model, ids, mask, routed_experts=records[rank])
    return dict(record=record, replay=replay["routed_experts"], logits=replay["logits"])


def test_ep2_over_gloo_equals_one_process():
    """Expert parallelism (each rank holds half the experts, its own batch of its own shape): each rank's record is
    the one process's, and replaying another record (the one process's after a router update) gives its logits."""
    import copy

    from packfwd.testing import run_local

    hf = hf_model("mixtral")
    batches = [ragged_batch(), ragged_batch(seed=5)]
    batches[1] = (batches[1][0][:3, :7], batches[1][1][:3, :7])
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        own = [forward(from_hf(hf), ids, mask)["routed_experts"] for ids, mask in batches]
        other = updated(copy.deepcopy(hf))
        records = [forward(from_hf(other), ids, mask)["routed_experts"] for ids, mask in batches]
        want = [make_forward("thd")(from_hf(hf), ids, mask, routed_experts=r) for (ids, mask), r in
                zip(batches, records)]
    assert not all(torch.equal(a, b) for a, b in zip(own, records))  # the other record moves some tokens
    ranks = run_local(_ep_worker, 2, hf, batches, records, backend="gloo", timeout=300)
    for rank, got in enumerate(ranks):
        assert torch.equal(got["record"], own[rank])
        assert torch.equal(got["replay"], records[rank])
        torch.testing.assert_close(got["logits"], want[rank], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_the_verl_engine_forward_replays_verls_jagged_routes(data_format):
    """``packfwd.verl.gptmodel_forward_model_engine(..., routed_experts=)`` (verl's routes, jagged ``[b, j, L, k]``
    int16 as verl records them) gives packfwd's own replay: the logits of ``make_forward``'s ``routed_experts=`` on
    the padded batch, after an update that moved tokens; a padded tensor is refused."""
    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.verl import gptmodel_forward_model_engine

    ensure_model_parallel()
    hf = hf_model("mixtral")
    ids, mask = ragged_batch()
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        recorded = forward(from_hf(hf), ids, mask)["routed_experts"]
    model = from_hf(updated(hf))
    jagged = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)], layout=torch.jagged)
    routes = torch.nested.nested_tensor([recorded[i][mask[i]].to(torch.int16) for i in range(4)], layout=torch.jagged)
    with torch.no_grad():
        want = forward(model, ids, mask, routed_experts=recorded)
        free = gptmodel_forward_model_engine(model, jagged, {}, data_format=data_format).values()
        got = gptmodel_forward_model_engine(model, jagged, {}, data_format=data_format, routed_experts=routes).values()
    torch.testing.assert_close(got, want["logits"][mask], atol=1e-5, rtol=1e-5)
    assert (free - got).abs().max() > 1e-3  # the free routing differs: the replay is what made them equal
    with pytest.raises(TypeError, match="routed_experts must be jagged like input_ids"):
        gptmodel_forward_model_engine(model, jagged, {}, routed_experts=recorded)
