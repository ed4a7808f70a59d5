"""The newer families under model parallelism, and an MoE model's masked-rows path.

Strategy: the tiny float64 models of ``tests/test_families.py`` (Qwen3 dense: QK-norm, 4 x 24 heads on hidden 32)
and ``tests/test_moe.py`` (Qwen3-MoE: 4 experts, top-2, a dense layer among MoE ones), O(1)-scale weights.  The
references are transformers run on each sequence alone (logits) and the one-process packfwd model (gradients,
expert load).  One ``run_local`` call over gloo runs every two-rank case in a row (the processes' start-up and
Megatron-Core's import are most of the cost):

* Qwen3 under TP=2 with sequence parallelism, THD and BSHD: the ranks' vocab slices are transformers' logits,
  their gradients merged (replicated weights, the norms, summed over the ranks: under SP each sees its share of
  the tokens) are the one-process model's;
* Qwen3 under CP=2 (THD): the all-gathered logits, and the ranks' gradients summed;
* Qwen3-MoE under TP=2 + SP through ``model(ids, None, attention_mask)`` (Megatron-Core's calling convention, what
  verl's BSHD forwards call): the 21 real tokens pack to 22 slots, and the pad slot reaches no expert; the load
  equals ``make_forward("thd")``'s and the one process's, also with padding columns added.

Pipeline parallelism runs both stages in this process (the first stage's output handed to the last through
``set_input_tensor``, as ``tests/test_forward.py`` does): Qwen3 in THD and BSHD (and gradients back through both
stages), Qwen3-MoE with its dense layer on the first stage (logits, expert load with alignment pads), and
``moe_aux_loss=True`` across the stages (the first hands on its routing sums: the whole model's loss and router
gradients, transformers' loss).  Over gloo, PP=2 x VPP=2 through ``run_micro_batches(pp_group=...)``: the step's
aux loss and every gradient equal one process's ``run_micro_batches`` of the same plan, and so does the routing
record (``record_routing=True``, handed on beside the sums); Megatron-Core's schedule, which sends one tensor per
stage, is refused for it.
"""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from packfwd.forward import make_forward
from packfwd.models import from_hf, megatron_to_hf
from packfwd.models.convert.hf import args_from_hf_config

from .oracles import assert_equals_hf_per_sequence
from .test_families import TINY, _loss, hf_model, hf_norm_in_input_dtype, ragged_batch  # noqa: F401 (a fixture)
from .test_moe import TINY as MOE_TINY
from .test_moe import expert_load, more_padding, randomise
from .test_moe import ragged_batch as moe_batch

V = TINY["vocab_size"]


def moe_model(layers: int = 3) -> torch.nn.Module:
    """Qwen3-MoE: layer 1 dense, the others 4 experts top-2 (normalised)."""
    config = Qwen3MoeConfig(**{**MOE_TINY, "num_hidden_layers": layers}, intermediate_size=48,
                            moe_intermediate_size=16, num_experts=4, norm_topk_prob=True, mlp_only_layers=[1],
                            head_dim=16)
    return randomise(Qwen3MoeForCausalLM(config))



def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


# ------------------------------------------------------------------------------------------------- two ranks


def _switch(tp: int = 1, cp: int = 1):
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ensure_model_parallel(tp_size=tp, cp_size=cp)
    return ps


def _ranks_worker(rank: int, world: int, dense, moe):
    """Every two-rank case, in a row: {case: this rank's outputs}."""
    from packfwd.models.runtime.cpu import host_collectives

    ids, mask = ragged_batch()
    out = {}
    ps = _switch(tp=2)
    v = V // 2
    for data_format in ("thd", "bshd"):
        model = from_hf(dense, tp_size=2, tp_rank=rank, sequence_parallel=True)
        logits = make_forward(data_format, tp_size=2)(model, ids, mask)
        with host_collectives():
            _loss(logits, mask, slice(rank * v, (rank + 1) * v)).backward()
        out[f"tp2_sp_{data_format}"] = dict(logits=logits.detach(), grads=grads(model))

    model = from_hf(moe, tp_size=2, tp_rank=rank, sequence_parallel=True)
    ids_m, mask_m = moe_batch()
    masked = lambda m, i, a: m(i, None, a)  # noqa: E731  (Megatron-Core's calling convention)
    out["moe_masked"] = dict(
        logits=masked(model, ids_m, mask_m).detach(), load=expert_load(model, masked, ids_m, mask_m),
        wide_load=expert_load(model, masked, *more_padding(ids_m, mask_m)),
        thd_load=expert_load(model, make_forward("thd", tp_size=2), ids_m, mask_m))

    ps = _switch(cp=2)
    model = from_hf(dense)
    forward = make_forward("thd", cp_size=2, cp_rank=ps.get_context_parallel_rank(),
                           cp_group=ps.get_context_parallel_group())
    logits = forward(model, ids, mask)
    with host_collectives():
        _loss(logits, mask).backward()
    out["cp2"] = dict(logits=logits.detach(), grads=grads(model))
    ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def two_ranks():
    from packfwd.testing import run_local

    dense, moe = hf_model("qwen3"), moe_model()
    return dense, moe, run_local(_ranks_worker, 2, dense, moe, backend="gloo", timeout=300)


@pytest.fixture(scope="module")
def dense_grads():
    """The one-process Qwen3's gradients of :func:`_loss` (Megatron names)."""
    model = from_hf(hf_model("qwen3"))
    ids, mask = ragged_batch()
    _loss(make_forward("thd")(model, ids, mask), mask).backward()
    return grads(model)


@pytest.mark.usefixtures("hf_norm_in_input_dtype")
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_qwen3_tp2_with_sequence_parallelism(two_ranks, dense_grads, data_format):
    dense, _, ranks = two_ranks
    got = [r[f"tp2_sp_{data_format}"] for r in ranks]
    ids, mask = ragged_batch()
    assert_equals_hf_per_sequence(dense, torch.cat([r["logits"] for r in got], -1), ids, mask)
    shards = [dict(r["grads"]) for r in got]
    for name, whole in dense_grads.items():  # replicated over TP (the norms): each rank's tokens' part
        if shards[0][name].shape == whole.shape:
            total = shards[0][name] + shards[1][name]
            shards[0][name] = shards[1][name] = total
    args = args_from_hf_config(dense.config)
    want = megatron_to_hf([dense_grads], args)
    merged = megatron_to_hf(shards, args)
    assert sorted(merged) == sorted(want)
    for name, grad in want.items():
        torch.testing.assert_close(merged[name], grad, atol=1e-10, rtol=1e-10, msg=name)


@pytest.mark.usefixtures("hf_norm_in_input_dtype")
def test_qwen3_cp2(two_ranks, dense_grads):
    dense, _, ranks = two_ranks
    ids, mask = ragged_batch()
    for r in ranks:
        assert_equals_hf_per_sequence(dense, r["cp2"]["logits"], ids, mask)
    for name, grad in dense_grads.items():  # each rank's share of the tokens
        total = ranks[0]["cp2"]["grads"][name] + ranks[1]["cp2"]["grads"][name]
        torch.testing.assert_close(total, grad, atol=1e-10, rtol=1e-10, msg=name)


def test_moe_masked_rows_route_no_pad_under_sequence_parallelism(two_ranks):
    """``model(ids, None, mask)`` packs 21 tokens to 22 slots under SP; before the plan's padding_mask reached the
    routers on this path, the pad slot was routed (4 more tokens in the load of the two MoE layers, top-2)."""
    _, moe, ranks = two_ranks
    ids, mask = moe_batch()
    whole = from_hf(moe)
    want_load = expert_load(whole, make_forward("thd"), ids, mask)
    assert want_load.sum() == 2 * 2 * mask.sum()
    with torch.no_grad():
        want_logits = make_forward("thd")(whole, ids, mask)
    for r in ranks:
        got = r["moe_masked"]
        for key in ("load", "wide_load", "thd_load"):
            assert torch.equal(got[key], want_load), (key, got[key].sum(), want_load.sum())
    logits = torch.cat([r["moe_masked"]["logits"] for r in ranks], -1)
    torch.testing.assert_close(logits, want_logits, atol=1e-10, rtol=0)


def test_moe_masked_rows_pass_the_callers_padding_mask():
    """A caller's ``padding_mask [b, s]`` on the masked-rows path is packed with the plan: those tokens reach no
    expert (before, the [b, s] mask met [1, t] packed ids and failed Megatron-Core's shape assertion)."""
    model = from_hf(moe_model())
    ids, mask = moe_batch()
    keep_out = torch.zeros_like(mask)
    keep_out[3, :6] = True  # the last row's 6 tokens
    call = lambda m, i, a: m(i, None, a, padding_mask=keep_out)  # noqa: E731
    load = expert_load(model, call, ids, mask)
    assert load.sum() == 2 * 2 * (mask.sum() - 6)
    assert torch.equal(load, expert_load(model, make_forward("thd"), ids[:3], mask[:3]))
    with pytest.raises(ValueError, match=r"padding_mask has shape \(4, 8\) but attention_mask has shape \(4, 9\)"):
        model(ids, None, mask, padding_mask=keep_out[:, :8])


# ------------------------------------------------------------------------------- two pipeline stages, one process


def run_stages(stages, forward, ids, mask):
    """The first stage's output handed to the last (detached: the backward crosses it in :func:`backward`)."""
    hidden = forward(stages[0], ids, mask)
    handed = hidden.detach().requires_grad_()
    stages[1].set_input_tensor(handed)
    return hidden, handed, forward(stages[1], ids, mask)


@pytest.mark.usefixtures("hf_norm_in_input_dtype")
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_qwen3_pp2(data_format, dense_grads):
    hf = hf_model("qwen3")
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    assert [len(s.decoder.layers) for s in stages] == [1, 1]
    ids, mask = ragged_batch()
    hidden, handed, logits = run_stages(stages, make_forward(data_format), ids, mask)
    assert_equals_hf_per_sequence(hf, logits.detach(), ids, mask)
    _loss(logits, mask).backward()
    hidden.backward(handed.grad)
    got = {**grads(stages[0]), **{n.replace("layers.0.", "layers.1."): g for n, g in grads(stages[1]).items()}}
    assert sorted(got) == sorted(dense_grads)
    for name, grad in dense_grads.items():
        torch.testing.assert_close(got[name], grad, atol=1e-10, rtol=1e-10, msg=name)


def test_qwen3_moe_pp2():
    """Stage 0: layers 0 (MoE) and 1 (dense); stage 1: layers 2 and 3 (MoE), routed without the pads of
    seq_align=8 although a later stage is given no input ids."""
    hf = moe_model(layers=4)
    whole = from_hf(hf)
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    assert [type(layer.mlp).__name__ for s in stages for layer in s.decoder.layers] == ["MoELayer", "MLP",
                                                                                         "MoELayer", "MoELayer"]
    ids, mask = moe_batch()
    forward = make_forward("thd", seq_align=8)
    with torch.no_grad():
        _, _, logits = run_stages(stages, forward, ids, mask)
        torch.testing.assert_close(logits, forward(whole, ids, mask), atol=1e-10, rtol=0)
    assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5)  # transformers routes in float32
    load = torch.cat([expert_load(stages[0], forward, ids, mask),
                      expert_load(stages[1], lambda m, *b: run_stages(stages, forward, *b)[2], ids, mask)])
    assert torch.equal(load, expert_load(whole, make_forward("thd"), ids, mask))


def _stage_grads(stage, first_layer: int) -> dict:
    """A stage's gradients by the whole model's parameter names."""
    def name_of(name):
        if not name.startswith("decoder.layers."):
            return name
        local, rest = name[len("decoder.layers."):].split(".", 1)
        return f"decoder.layers.{int(local) + first_layer}.{rest}"

    return {name_of(n): p.grad.clone() for n, p in stage.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("data_format, layout", [("thd", {"seq_align": 8}), ("bshd", {})])
def test_qwen3_moe_pp2_aux_loss_pools_both_stages(data_format, layout):
    """Stage 0 (layers 0: MoE, 1: dense) returns (hidden, routing sums [2E + 1] float64); stage 1 takes them as
    ``moe_routing=``, in THD with alignment pads and in BSHD (padding columns): its ``moe_aux_loss`` is the whole
    model's and transformers'; backpropagating it alone through
    both stages gives every router the whole model's gradient (stage 0's router gets its share only through the
    handed-on sums)."""
    from .test_moe import hf_aux_loss

    hf = moe_model(layers=4)
    whole = from_hf(hf)
    stages = [from_hf(hf, pp_rank=r, pp_size=2) for r in range(2)]
    ids, mask = moe_batch()
    forward = make_forward(data_format, moe_aux_loss=True, **layout)
    want = forward(whole, ids, mask)
    want["moe_aux_loss"].backward()
    want_grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}
    assert sorted(n for n in want_grads if n.endswith("router.weight")) == [
        f"decoder.layers.{i}.mlp.router.weight" for i in (0, 2, 3)]

    hidden, routing = forward(stages[0], ids, mask)
    assert routing.dtype == torch.float64 and routing.shape == (2 * 4 + 1,) and routing.requires_grad
    handed, sums = hidden.detach().requires_grad_(), routing.detach().requires_grad_()
    stages[1].set_input_tensor(handed)
    got = forward(stages[1], ids, mask, moe_routing=sums)
    assert got["moe_aux_loss"].dtype == torch.float64  # the model's dtype (float64 here)
    torch.testing.assert_close(got["moe_aux_loss"], want["moe_aux_loss"], atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(got["logits"], want["logits"], atol=1e-10, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(got["moe_aux_loss"], hf_aux_loss(hf, ids, mask).double(), atol=1e-5, rtol=1e-5)
    got["moe_aux_loss"].backward()
    torch.autograd.backward([hidden, routing], [handed.grad, sums.grad])
    merged = {**_stage_grads(stages[0], 0), **_stage_grads(stages[1], 2)}
    assert sorted(merged) == sorted(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(merged[name], grad, atol=1e-12, rtol=1e-10, msg=name)

    empty = torch.zeros_like(mask)  # nothing to route: the sums handed on are zeros, and the loss is 0
    hidden, routing = forward(stages[0], ids, empty)
    assert not routing.any()
    stages[1].set_input_tensor(hidden)
    assert forward(stages[1], ids, empty, moe_routing=routing)["moe_aux_loss"].item() == 0.0

    with pytest.raises(ValueError, match="later pipeline stage needs the earlier stages' routing: pass moe_routing="):
        forward(stages[1], ids, mask)
    with pytest.raises(ValueError, match="moe_routing= given to the first pipeline stage"):
        forward(stages[0], ids, mask, moe_routing=sums)
    with pytest.raises(ValueError, match=r"routing sums are torch.float32 \(9,\); pass the earlier stage's float64"):
        forward(stages[1], ids, mask, moe_routing=sums.float())
    with pytest.raises(TypeError, match="moe_routing= .* is taken by a make_forward\\(..., moe_aux_loss=True\\)"):
        make_forward(data_format, **layout)(stages[1], ids, mask, moe_routing=sums)
    fewer = mask.clone()
    fewer[0] = False  # another micro-batch: its sums count fewer real tokens than this batch routes per layer
    assert fewer.any() and fewer.sum() < mask.sum()
    with torch.no_grad():
        other = forward(stages[0], ids, fewer)[1]
        stages[1].set_input_tensor(handed.detach())
        with pytest.raises(ValueError, match="moe_routing= counts routed tokens .* another micro-batch"):
            forward(stages[1], ids, mask, moe_routing=other)


def _aux_loss(out):
    """Per-token losses of a micro-batch: its aux loss on every token, and one logit."""
    return out["moe_aux_loss"].expand(out["logits"].shape[:2]) + 0.1 * out["logits"][..., 3]


def _pp_aux_worker(rank: int, world: int, hf, max_tokens: int):
    """PP=2 x VPP=2 (global stages: layer 0 MoE, 1 dense, 2 and 3 MoE) through run_micro_batches."""
    from megatron.core import parallel_state as ps

    from packfwd.micro import plan_micro_batches, run_micro_batches
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(pp_size=2, vpp_size=2)
    stages = [from_hf(hf, pp_rank=rank, pp_size=2, vpp_rank=v, vpp_size=2) for v in range(2)]
    ids, mask = moe_batch()
    forward = make_forward("thd", seq_align=8, moe_aux_loss=True, record_routing=True)
    plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=max_tokens, **forward.layout.plan_args)
    try:  # Megatron-Core's schedule sends one tensor per stage: refused before it runs anything
        run_micro_batches(forward, stages, plan, ids, mask, dp_rank=0, loss_fn=_aux_loss, schedule="megatron",
                          pp_group=ps.get_pipeline_model_parallel_group())
        refused = None
    except ValueError as exc:
        refused = str(exc)
    got = run_micro_batches(forward, stages, plan, ids, mask, dp_rank=0, loss_fn=_aux_loss,
                            pp_group=ps.get_pipeline_model_parallel_group())
    grads = {**_stage_grads(stages[0], rank), **_stage_grads(stages[1], 2 + rank)}
    ps.destroy_model_parallel()
    return dict(grads=grads, refused=refused,
                result=None if got is None else (got.loss, got.moe_aux_loss, got.outputs["logits"],
                                                 got.outputs["routed_experts"]))


def test_moe_aux_loss_through_run_micro_batches_pp2_vpp2_over_gloo():
    """The routing sums and the routing record (``record_routing=True``) travel the chain of four global stages
    (one with no MoE layer, and back from rank 1 to rank 0 between virtual stages), the sums' gradients back: the
    step's loss, aux loss, logits and every gradient equal one process's run_micro_batches of the same plan
    (several micro-batches), and the record, every stage's MoE layers joined, is its record bit for bit."""
    from packfwd.micro import plan_micro_batches, run_micro_batches
    from packfwd.testing import run_local

    hf, max_tokens = moe_model(layers=4), 16
    whole = from_hf(hf)
    ids, mask = moe_batch()
    forward = make_forward("thd", seq_align=8, moe_aux_loss=True, record_routing=True)
    plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=max_tokens, **forward.layout.plan_args)
    assert plan.num_micro_batches > 1
    want = run_micro_batches(forward, whole, plan, ids, mask, dp_rank=0, loss_fn=_aux_loss)
    want_grads = {n: p.grad for n, p in whole.named_parameters() if p.grad is not None}

    first, last = run_local(_pp_aux_worker, 2, hf, max_tokens, backend="gloo", timeout=300)
    for rank in (first, last):
        assert rank["refused"].startswith("schedule='megatron' with a moe_aux_loss=True and record_routing=True "
                                          "forward"), rank["refused"]
    assert first["result"] is None
    loss, aux, logits, record = last["result"]
    assert torch.equal(record, want.outputs["routed_experts"]) and record.shape[2] == 3  # MoE layers 0, 2, 3
    assert (record[~mask] == -1).all()
    torch.testing.assert_close(aux, want.moe_aux_loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(loss, want.loss, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logits, want.outputs["logits"], atol=1e-10, rtol=0)
    merged = {**first["grads"], **last["grads"]}
    assert sorted(merged) == sorted(want_grads)
    for name, grad in want_grads.items():
        torch.testing.assert_close(merged[name], grad, atol=1e-12, rtol=1e-10, msg=name)
