"""Expert parallelism (EP=2 over gloo): each rank holds half the experts and a batch of its own shape.

Expert-parallel ranks are data-parallel ranks: rank 0 runs a [4, 9] ragged batch, rank 1 a [3, 6] one (fewer
tokens: its dispatcher pads them to rank 0's count).  Each rank's logits equal transformers run on each of its
sequences alone, and the single-process model's on the same batch; the expert weights' gradients on each rank
equal the single-process model's gradients of the loss summed over both batches (nothing to all-reduce: each
expert lives on one rank), the other weights' after the data-parallel all-reduce; the experts' load counts real
tokens only; ``to_hf_state_dict`` gathers the experts back bit for bit.

EP=2 x TP=2 with sequence parallelism (four processes, TP fastest): the two TP ranks of an expert-parallel rank
share its batch, each routing its slice of the tokens; the experts are TP-sharded as the dense MLP is (Megatron-Core's
default ``expert_tensor_parallel_size``, TP's).  The same checks, with the TP shards merged.  EP x PP, EP with
whole experts under TP (ETP=1), and EP with CP (Megatron-Core's expert-parallel ranks drawn from the CP x DP ranks)
likewise.
"""

from __future__ import annotations

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import from_hf, to_hf_state_dict
from packfwd.models.mlp.moe_weights import expert_shard
from tests.oracles import assert_equals_hf_per_sequence
from tests.test_moe import V, expert_load, hf_model, ragged_batch


def small_batch(seed: int = 1):
    """ids [3, 6]: lengths 6, 2 (left-padded), 4 (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0], mask[1, 4:], mask[2, :4] = True, True, True
    return torch.randint(1, V, (3, 6), generator=g).masked_fill(~mask, 0), mask


def loss_of(logits, rank: int, vocab: slice = slice(None)):
    """A loss that weighs every logit differently (fixed per rank); a TP rank's ``vocab`` slice of it."""
    g = torch.Generator().manual_seed(100 + rank)
    weights = torch.randn((*logits.shape[:-1], V), generator=g, dtype=logits.dtype)
    return (logits * weights[..., vocab]).sum()


def one_process(hf, batches):
    """The reference of every test here: one process's model of ``hf``, its THD logits of each batch, the experts'
    load over all batches, and (on its parameters) the gradients of the loss summed over the batches."""
    model = from_hf(hf)
    want_logits, want_load, total = [], 0, 0
    for rank, (ids, mask) in enumerate(batches):
        logits = make_forward("thd")(model, ids, mask)
        want_logits.append(logits.detach())
        total = total + loss_of(logits, rank)
        want_load = want_load + expert_load(model, make_forward("thd"), ids, mask)
    total.backward()
    return model, want_logits, want_load


def aux_of(model, forward, ids, mask):
    """An aux-loss-only forward and backward of ``model`` (its gradients zeroed first): the loss and the routers'
    weight gradients."""
    from packfwd.models.runtime.cpu import host_collectives

    model.zero_grad(set_to_none=True)
    loss = forward(model, ids, mask)["moe_aux_loss"]
    with host_collectives():
        loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("router.weight")}


def one_process_aux(hf, batches):
    """Per batch, one process's ``moe_aux_loss`` and the routers' gradients of it alone."""
    model = from_hf(hf)
    return [aux_of(model, make_forward("thd", moe_aux_loss=True), ids, mask) for ids, mask in batches]


def _ep_worker(rank: int, world: int, hf, batches):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(ep_size=2)
    model = from_hf(hf, ep_size=2, ep_rank=rank)
    ids, mask = batches[rank]
    load = expert_load(model, make_forward("thd"), ids, mask)
    logits = make_forward("thd")(model, ids, mask)
    with host_collectives():
        loss_of(logits, rank).backward()
    grads = {}
    for name, p in model.named_parameters():
        if ".local_experts." not in name:  # the data-parallel all-reduce of the replicated weights
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        grads[name] = p.grad.clone()
    aux = aux_of(model, make_forward("thd", moe_aux_loss=True), ids, mask)  # this rank's batch's, no all-reduce
    state = to_hf_state_dict(model)
    experts = sum(1 for n in grads if n.startswith("decoder.layers.0.mlp.experts.local_experts."))
    refused = []  # a rank that skips the model would leave its expert-parallel peer waiting in the token exchange
    from packfwd.micro import plan_micro_batches, run_micro_batches

    empty = torch.zeros_like(mask)
    one = plan_micro_batches([int(mask[0].sum())], max_tokens=64, min_micro_batches=2)  # one micro-batch empty
    for call in (lambda: make_forward("thd")(model, ids, empty),
                 lambda: run_micro_batches(make_forward("thd"), model, one, ids[:1], mask[:1], dp_rank=0)):
        try:
            call()
        except ValueError as error:
            refused.append("expert-parallel peers" in str(error))
    ps.destroy_model_parallel()
    return dict(logits=logits.detach(), grads=grads, load=load, state=state, experts_in_layer0=experts,
                refused=refused, aux=aux)


@pytest.mark.parametrize("name", ["qwen3_moe-norm", "qwen2_moe"])  # Qwen2-MoE: a gated shared expert on every rank
def test_ep2_ranks_with_batches_of_their_own_shape_equal_one_process(name):
    from packfwd.testing import run_local

    hf = hf_model(name)
    batches = [ragged_batch(), small_batch()]
    model, want_logits, want_load = one_process(hf, batches)
    want_grads = {n: p.grad for n, p in model.named_parameters()}

    ranks = run_local(_ep_worker, 2, hf, batches, backend="gloo", timeout=300)
    want_aux = one_process_aux(hf, batches)
    for rank, ((ids, mask), got) in enumerate(zip(batches, ranks)):
        # the aux loss of the rank's own batch (the dispatcher's pads never count), and its router gradients
        torch.testing.assert_close(got["aux"][0], want_aux[rank][0], atol=1e-12, rtol=1e-12)
        assert sorted(got["aux"][1]) == sorted(want_aux[rank][1])
        for name, grad in want_aux[rank][1].items():
            torch.testing.assert_close(got["aux"][1][name], grad, atol=1e-12, rtol=1e-10, msg=name)
        assert got["experts_in_layer0"] == 2 * 2  # 2 of 4 experts, linear_fc1 and linear_fc2 each
        assert got["refused"] == [True, True]  # an empty batch and a plan with an empty micro-batch
        logits = got["logits"]
        torch.testing.assert_close(logits, want_logits[rank], atol=1e-10, rtol=0)
        assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5, what=f"rank {rank} ")
        mine = expert_shard(want_grads, 4, ep_size=2, ep_rank=rank)
        assert sorted(got["grads"]) == sorted(mine)
        for name, grad in mine.items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-10, rtol=1e-10, msg=name)
        state, hf_state = got["state"], hf.state_dict()
        assert sorted(state) == sorted(hf_state)
        assert all(torch.equal(state[k], v) for k, v in hf_state.items())
    # each rank's experts see both ranks' real tokens: [layers, 2] per rank, side by side = the whole [layers, 4]
    load = torch.cat([r["load"] for r in ranks], dim=-1)
    assert torch.equal(load, want_load)
    assert load.sum() == 2 * 2 * sum(mask.sum() for _, mask in batches)  # two MoE layers, top-2, no pad routed


def test_ep_refusals():
    from packfwd.models.runtime.gpt import _check_expert_parallel
    from packfwd.models.convert.hf import args_from_hf_config
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    args = args_from_hf_config(hf_model("qwen3_moe-norm").config)
    with pytest.raises(ValueError, match="num_experts=4 does not split over ep_size=3"):
        _check_expert_parallel(args, 3, 1, 1)
    with pytest.raises(NotImplementedError, match="ep_size=2 with tp_size=2 and sequence_parallel=False"):
        _check_expert_parallel(args, 2, 2, 1)
    assert _check_expert_parallel(args, 2, 2, 1, sequence_parallel=True, etp=2) == 2
    assert _check_expert_parallel(args, 2, 2, 1, sequence_parallel=True, etp=1) == 2  # test_ep2_with_tp2_etp1_...
    with pytest.raises(NotImplementedError, match="expert_tensor_parallel_size=2 and tp_size=4"):
        _check_expert_parallel(args, 2, 4, 1, sequence_parallel=True, etp=2)
    with pytest.raises(NotImplementedError, match="ep_size=1 with expert_tensor_parallel_size=1 and tp_size=2"):
        _check_expert_parallel(args, 1, 2, 1, sequence_parallel=True, etp=1)
    assert _check_expert_parallel(args, 2, 2, 2, sequence_parallel=True) == 2  # PP: test_ep2_with_pp2_...
    assert _check_expert_parallel(args, 1, 2, 2) == 1
    with pytest.raises(ValueError, match="ep_size=2, ep_rank=2 for 4 experts"):
        expert_shard({}, 4, ep_size=2, ep_rank=2)


def _tp_ep_worker(rank: int, world: int, hf, batches, dense):
    """(tp, ep) = (rank % 2, rank // 2): TP fastest, the expert-parallel ranks are the data-parallel ones."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.convert.hf import _weights
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=2, ep_size=2)
    tp, ep = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    model = from_hf(hf, tp_size=2, tp_rank=tp, ep_size=2, ep_rank=ep, sequence_parallel=True)
    ids, mask = batches[ep]
    load = expert_load(model, make_forward("thd", tp_size=2), ids, mask)
    logits = make_forward("thd", tp_size=2)(model, ids, mask)  # this TP rank's half of the vocabulary
    with host_collectives():
        loss_of(logits, ep, vocab=slice(tp * V // 2, (tp + 1) * V // 2)).backward()
    grads = {}
    for name, p in model.named_parameters():
        if ".local_experts." not in name:  # the data-parallel all-reduce of the weights the EP ranks replicate
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        grads[name] = p.grad.clone()
    aux = aux_of(model, make_forward("thd", tp_size=2, moe_aux_loss=True), ids, mask)
    weights = {n: t.detach().clone() for n, t in _weights(model).items()}
    state = to_hf_state_dict(model)  # gathers over the expert-parallel group, then the TP group
    dense_state = to_hf_state_dict(from_hf(dense, tp_size=2, tp_rank=tp))  # a dense model: the TP group only
    ps.destroy_model_parallel()
    return dict(tp=tp, ep=ep, logits=logits.detach(), grads=grads, weights=weights, state=state, load=load,
                dense_state=dense_state, etp=model.config.expert_tensor_parallel_size, aux=aux)


def test_ep2_with_tp2_sp_equals_one_process():
    """EP=2 x TP=2 (+SP), four gloo processes: ranks (tp0, ep0), (tp1, ep0) run batch A, (tp0, ep1), (tp1, ep1)
    batch B (another shape); the experts' tensor-parallel size is TP's (Megatron-Core's default), so the
    dispatcher gathers the tokens of all four ranks (each SP rank's slice, padded to the most), and each rank's
    experts are handed every real token routed to them, no pad.  Logits equal transformers per sequence and the
    single process's; every gradient equals the single process's gradient of the loss summed over both batches, TP- and EP-sharded (a weight TP replicates: summed over the two TP ranks,
    each holding its tokens' part); the weights merge back to the HF state dict bit for bit, and ``to_hf_state_dict``
    gives it on every rank (and a dense Qwen3's under TP=2 too)."""
    from packfwd.models import megatron_to_hf
    from packfwd.models.convert.hf import args_from_hf_config
    from packfwd.models.mlp.moe_weights import merge_expert_shards
    from packfwd.models.convert.hf_weights import hf_to_megatron
    from packfwd.testing import run_local
    from tests.test_families import hf_model as dense_model

    hf = hf_model("qwen3_moe-norm")
    batches = [ragged_batch(), small_batch()]
    model, want_logits, want_load = one_process(hf, batches)
    args = args_from_hf_config(hf.config)
    whole = {n: p.grad for n, p in model.named_parameters()}
    want_hf = megatron_to_hf([whole], args)

    dense = dense_model("qwen3")
    ranks = run_local(_tp_ep_worker, 4, hf, batches, dense, backend="gloo", timeout=300)
    by = {(r["tp"], r["ep"]): r for r in ranks}
    check_tp_aux(by, one_process_aux(hf, batches))
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)] and [r["etp"] for r in ranks] == [2] * 4
    for ep, (ids, mask) in enumerate(batches):
        logits = torch.cat([by[0, ep]["logits"], by[1, ep]["logits"]], dim=-1)
        torch.testing.assert_close(logits, want_logits[ep], atol=1e-10, rtol=0)
        assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5, what=f"ep rank {ep} ")
        for tp in (0, 1):  # SP slices of 11 / 6 tokens (one SP pad in A), padded to 11: no pad routed
            assert torch.equal(by[tp, ep]["load"], want_load[:, 2 * ep:2 * ep + 2])
            mine = expert_shard(hf_to_megatron(want_hf, args, tp_size=2, tp_rank=tp), 4, ep_size=2, ep_rank=ep)
            got = by[tp, ep]["grads"]
            assert sorted(got) == sorted(mine)
            assert sum(".local_experts." in n for n in got) == 2 * 2 * 2  # 2 MoE layers x 2 experts x fc1, fc2
            for name, grad in mine.items():
                g = got[name] + by[1 - tp, ep]["grads"][name] if grad.shape == whole[name].shape else got[name]
                torch.testing.assert_close(g, grad, atol=1e-10, rtol=1e-10, msg=name)
    shards = [merge_expert_shards([by[tp, 0]["weights"], by[tp, 1]["weights"]]) for tp in (0, 1)]
    hf_state = hf.state_dict()
    for back in [megatron_to_hf(shards, args)] + [r["state"] for r in ranks]:
        assert sorted(back) == sorted(hf_state) and all(torch.equal(back[k], v) for k, v in hf_state.items())
    dense_state = dense.state_dict()
    for back in [r["dense_state"] for r in ranks]:
        assert sorted(back) == sorted(dense_state) and all(torch.equal(back[k], v) for k, v in dense_state.items())


def check_tp_aux(by, want_aux):
    """``by[tp, batch]["aux"]``: each TP rank's aux loss is its whole batch's (the SP slices' routing pooled over
    the TP group), and the two TP ranks' router gradients sum to the one process's."""
    for b, (loss, grads) in enumerate(want_aux):
        for tp in (0, 1):
            torch.testing.assert_close(by[tp, b]["aux"][0], loss, atol=1e-12, rtol=1e-12, msg=f"{tp=} {b=}")
        assert sorted(by[0, b]["aux"][1]) == sorted(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(by[0, b]["aux"][1][name] + by[1, b]["aux"][1][name], grad, atol=1e-12,
                                       rtol=1e-10, msg=f"{b=} {name}")


def _pp_ep_worker(rank: int, world: int, hf, batches):
    """(ep, pp) = (rank % 2, rank // 2): each pipeline stage's two expert-parallel (data-parallel) ranks run their
    own batches, two micro-batches each, through packfwd's CPU pipeline schedule."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.moe.experts import SequentialMLP

    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.parallel import pipeline_forward_backward

    ensure_model_parallel(pp_size=2, ep_size=2)
    pp, ep = ps.get_pipeline_model_parallel_rank(), ps.get_expert_model_parallel_rank()
    stage = from_hf(hf, pp_rank=pp, pp_size=2, ep_size=2, ep_rank=ep)
    ids, mask = batches[ep]
    weights = torch.randn((*ids.shape, V), generator=torch.Generator().manual_seed(100 + ep), dtype=torch.float64)
    rows = torch.arange(ids.shape[0]).chunk(2)  # A: 2 + 2 rows, B: 2 + 1
    loads = []
    hooks = [m.register_forward_pre_hook(lambda m, a: loads.append(a[1].clone()))
             for m in stage.modules() if isinstance(m, SequentialMLP)]
    outs = pipeline_forward_backward(
        [stage], lambda s, r: make_forward("thd")(s, ids[r], mask[r]), rows,
        pp_group=ps.get_pipeline_model_parallel_group(),
        loss_fn=lambda logits, r: (logits * weights[r]).sum())  # summed: loss_of(the whole batch's logits, ep)
    for h in hooks:
        h.remove()
    grads = {}
    for name, p in stage.named_parameters():
        if ".local_experts." not in name:  # the data-parallel all-reduce of the weights the EP ranks replicate
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        grads[name] = p.grad.clone()
    moe_layers = len(loads) // len(rows)  # per micro-batch, in layer order: summed over the micro-batches
    load = torch.stack(loads).view(len(rows), moe_layers, -1).sum(0)
    state = to_hf_state_dict(stage)  # this stage's part, the experts gathered over its expert-parallel group
    layers = [layer.layer_number - 1 for layer in stage.decoder.layers]
    ps.destroy_model_parallel()
    return dict(pp=pp, ep=ep, logits=None if outs is None else torch.cat([o.detach() for o in outs]), grads=grads,
                load=load, state=state, layers=layers)


def test_ep2_with_pp2_equals_one_process():
    """EP=2 x PP=2, four gloo processes: ranks (pp0, ep0), (pp1, ep0) run batch A, (pp0, ep1), (pp1, ep1) batch B
    (another shape), in two micro-batches each through packfwd.parallel.pipeline_forward_backward.  Stage 0 holds
    layers 0 (MoE) and 1 (dense), stage 1 layers 2 and 3 (MoE); each stage's MoE layers exchange tokens over that
    stage's expert-parallel group (Megatron-Core's pipeline groups are the same for the expert and dense parts).
    The last stage's logits equal transformers per sequence and the single process's; every gradient equals the
    single process's gradient of the loss summed over both batches (EP-sharded experts); each expert is handed every
    real token routed to it and no pad; the stages' parts of the HF state dict make it whole, bit for bit."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from packfwd.models import megatron_to_hf
    from packfwd.models.convert.hf import args_from_hf_config
    from packfwd.models.convert.hf_weights import hf_to_megatron
    from packfwd.testing import run_local
    from tests.test_moe import CONFIGS, TINY, randomise

    hf = randomise(Qwen3MoeForCausalLM(Qwen3MoeConfig(**{**TINY, "num_hidden_layers": 4},
                                                      **CONFIGS["qwen3_moe-norm"][1])))
    batches = [ragged_batch(), small_batch()]
    model, want_logits, want_load = one_process(hf, batches)
    args = args_from_hf_config(hf.config)
    want_hf = megatron_to_hf([{n: p.grad for n, p in model.named_parameters()}], args)

    ranks = run_local(_pp_ep_worker, 4, hf, batches, backend="gloo", timeout=300)
    by = {(r["pp"], r["ep"]): r for r in ranks}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [by[pp, 0]["layers"] for pp in (0, 1)] == [[0, 1], [2, 3]]
    for ep, (ids, mask) in enumerate(batches):
        assert by[0, ep]["logits"] is None
        logits = by[1, ep]["logits"]
        torch.testing.assert_close(logits, want_logits[ep], atol=1e-10, rtol=0)
        assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5, what=f"ep rank {ep} ")
        for pp, moe in ((0, slice(0, 1)), (1, slice(1, 3))):
            got = by[pp, ep]
            assert torch.equal(got["load"], want_load[moe, 2 * ep:2 * ep + 2])
            mine = expert_shard(hf_to_megatron(want_hf, args, layers=got["layers"], pre_process=pp == 0,
                                               post_process=pp == 1), 4, ep_size=2, ep_rank=ep)
            assert sorted(got["grads"]) == sorted(mine)
            assert sum(".local_experts." in n for n in mine) == 2 * 2 * (moe.stop - moe.start)
            for name, grad in mine.items():
                torch.testing.assert_close(got["grads"][name], grad, atol=1e-10, rtol=1e-10, msg=f"{pp=} {name}")
    assert want_load.sum() == 3 * 2 * sum(mask.sum() for _, mask in batches)  # 3 MoE layers, top-2, no pad
    hf_state = hf.state_dict()
    for ep in (0, 1):
        back = {**by[0, ep]["state"], **by[1, ep]["state"]}
        assert not set(by[0, ep]["state"]) & set(by[1, ep]["state"])
        assert sorted(back) == sorted(hf_state) and all(torch.equal(back[k], v) for k, v in hf_state.items())


def _tp_etp1_worker(rank: int, world: int, hf, batches):
    """TP=2 (+SP), experts whole (ETP=1), EP=2: Megatron-Core's expert grid makes each TP group an expert-parallel
    group, so (tp, ep, dp) = (rank % 2, rank % 2, rank // 2), and the experts are replicated over the DP ranks."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.convert.hf import _weights
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=2, ep_size=2, etp_size=1)
    tp, ep, dp = ps.get_tensor_model_parallel_rank(), ps.get_expert_model_parallel_rank(), ps.get_data_parallel_rank()
    groups = [dist.get_process_group_ranks(g) for g in (ps.get_tensor_model_parallel_group(),
                                                         ps.get_expert_model_parallel_group())]
    model = from_hf(hf, tp_size=2, tp_rank=tp, ep_size=2, ep_rank=ep, expert_tp_size=1, sequence_parallel=True)
    ids, mask = batches[dp]
    load = expert_load(model, make_forward("thd", tp_size=2), ids, mask)
    logits = make_forward("thd", tp_size=2)(model, ids, mask)  # this TP rank's half of the vocabulary
    with host_collectives():
        loss_of(logits, dp, vocab=slice(tp * V // 2, (tp + 1) * V // 2)).backward()
    grads = {}
    for name, p in model.named_parameters():  # experts over the expert-DP ranks, the rest over the DP ranks
        expert = ".local_experts." in name
        dist.all_reduce(p.grad, group=ps.get_expert_data_parallel_group() if expert else ps.get_data_parallel_group())
        grads[name] = p.grad.clone()
    aux = aux_of(model, make_forward("thd", tp_size=2, moe_aux_loss=True), ids, mask)
    weights = {n: t.detach().clone() for n, t in _weights(model).items()}
    state = to_hf_state_dict(model)
    ps.destroy_model_parallel()
    return dict(tp=tp, ep=ep, dp=dp, groups=groups, logits=logits.detach(), grads=grads, weights=weights,
                state=state, load=load, etp=model.config.expert_tensor_parallel_size, aux=aux)


def test_ep2_with_tp2_sp_etp1_equals_one_process():
    """TP=2 (+SP) with whole experts (Megatron-Core's ``expert_tensor_parallel_size=1``, as Qwen3-MoE recipes run)
    and EP=2, four gloo processes: each TP group is an expert-parallel group (Megatron-Core's expert grid: ETP, EP,
    then expert-DP), so TP rank r holds experts [2r, 2r + 2) whole, the dense weights TP-sharded; ranks 0, 1 run
    batch A, ranks 2, 3 batch B (another shape).  Logits equal transformers per sequence and the single process's;
    each expert is handed its batch's real tokens routed to it and no pad (SP pad of A); every gradient equals the
    single process's of the loss summed over both batches (experts all-reduced over expert-DP, other weights over
    DP; a weight TP replicates summed over the TP ranks); experts whole and bit for bit; to_hf_state_dict gives the
    HF state dict bit for bit on every rank."""
    from packfwd.models import megatron_to_hf
    from packfwd.models.convert.hf import args_from_hf_config
    from packfwd.models.convert.hf_weights import hf_to_megatron
    from packfwd.testing import run_local

    hf = hf_model("qwen3_moe-norm")
    batches = [ragged_batch(), small_batch()]
    model, want_logits, _ = one_process(hf, batches)
    args = args_from_hf_config(hf.config)
    whole = {n: p.grad for n, p in model.named_parameters()}
    whole_experts = {n: g for n, g in whole.items() if ".local_experts." in n}
    want_hf = megatron_to_hf([whole], args)
    loads = [expert_load(model, make_forward("thd"), ids, mask) for ids, mask in batches]

    ranks = run_local(_tp_etp1_worker, 4, hf, batches, backend="gloo", timeout=300)
    by = {(r["tp"], r["dp"]): r for r in ranks}
    check_tp_aux(by, one_process_aux(hf, batches))
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)] and [r["etp"] for r in ranks] == [1] * 4
    for r in ranks:
        assert r["ep"] == r["tp"] and r["groups"] == [[2 * r["dp"], 2 * r["dp"] + 1]] * 2  # EP group = TP group
    params = dict(model.named_parameters())
    for dp, (ids, mask) in enumerate(batches):
        logits = torch.cat([by[0, dp]["logits"], by[1, dp]["logits"]], dim=-1)
        torch.testing.assert_close(logits, want_logits[dp], atol=1e-10, rtol=0)
        assert_equals_hf_per_sequence(hf, logits, ids, mask, atol=2e-5, rtol=1e-5, what=f"dp rank {dp} ")
        for tp in (0, 1):
            got = by[tp, dp]
            assert torch.equal(got["load"], loads[dp][:, 2 * tp:2 * tp + 2])  # the EP group is batch dp's only
            mine = expert_shard({**hf_to_megatron(want_hf, args, tp_size=2, tp_rank=tp), **whole_experts}, 4,
                                ep_size=2, ep_rank=tp)
            assert sorted(got["grads"]) == sorted(mine)
            experts = [n for n in mine if ".local_experts." in n]
            assert len(experts) == 2 * 2 * 2  # 2 MoE layers x 2 experts x fc1, fc2: whole, [2f, h] and [h, f]
            for name in experts:
                assert got["weights"][name].shape == params[name].shape
                assert torch.equal(got["weights"][name], expert_shard(params, 4, 2, tp)[name].detach())
            for name, grad in mine.items():
                replicated = ".local_experts." not in name and grad.shape == whole[name].shape
                g = got["grads"][name] + by[1 - tp, dp]["grads"][name] if replicated else got["grads"][name]
                torch.testing.assert_close(g, grad, atol=1e-10, rtol=1e-10, msg=f"{tp=} {dp=} {name}")
    assert sum(load.sum() for load in loads) == 2 * 2 * sum(mask.sum() for _, mask in batches)  # no pad routed
    hf_state = hf.state_dict()
    for back in [r["state"] for r in ranks]:
        assert sorted(back) == sorted(hf_state) and all(torch.equal(back[k], v) for k, v in hf_state.items())


def _cp_ep_worker(rank: int, world: int, hf, batches):
    """CP=2, DP=2, EP=4 (each rank one expert): Megatron-Core draws the expert-parallel ranks from the CP x DP ranks,
    so one expert-parallel group holds both CP shares of batch A (ranks 0, 1) and of batch B (ranks 2, 3)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(cp_size=2, ep_size=4)
    cp, dp, ep = ps.get_context_parallel_rank(), ps.get_data_parallel_rank(), ps.get_expert_model_parallel_rank()
    group = dist.get_process_group_ranks(ps.get_expert_model_parallel_group())
    model = from_hf(hf, ep_size=4, ep_rank=ep)
    ids, mask = batches[dp]
    forward = make_forward("thd", cp_size=2, cp_rank=cp, cp_group=ps.get_context_parallel_group())
    load = expert_load(model, forward, ids, mask)
    logits = forward(model, ids, mask)  # the whole batch's, gathered over the CP group
    with host_collectives():
        loss_of(logits, dp).backward()  # both CP ranks of a batch take the same loss: their gradients add up
    grads = {}
    for name, p in model.named_parameters():  # experts: nothing to reduce (one copy each); the rest over CP x DP
        if ".local_experts." not in name:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group(with_context_parallel=True))
        grads[name] = p.grad.clone()
    aux = aux_of(model, make_forward("thd", cp_size=2, cp_rank=cp, cp_group=ps.get_context_parallel_group(),
                                     moe_aux_loss=True), ids, mask)
    state = to_hf_state_dict(model)
    ps.destroy_model_parallel()
    return dict(cp=cp, dp=dp, ep=ep, group=group, logits=logits.detach(), grads=grads, load=load, aux=aux,
                state=state)


def test_ep4_with_cp2_and_dp2_equals_one_process():
    """Expert parallelism with context parallelism, four gloo processes (CP=2 x DP=2, EP=4 over all of them): an
    expert-parallel rank's tokens are its CP share of its own batch (A on ranks 0, 1; B, another shape, on 2, 3), each
    share padded to 2 x CP per sequence; the dispatcher exchanges the four ranks' real tokens and no pad.  Logits equal
    transformers per sequence and the single process's; each expert is handed every real token routed to it (the
    single process's load over both batches); expert gradients equal the single process's of the loss summed over
    both batches, the other weights' after the CP x DP all-reduce; each rank's aux loss is its batch's, the two CP
    ranks' router gradients summing to the single process's; to_hf_state_dict gives the HF state dict bit for bit."""
    from packfwd.testing import run_local

    hf = hf_model("qwen3_moe-norm")
    batches = [ragged_batch(), small_batch()]
    model, want_logits, want_load = one_process(hf, batches)
    want_grads = {n: p.grad for n, p in model.named_parameters()}
    want_aux = one_process_aux(hf, batches)

    ranks = run_local(_cp_ep_worker, 4, hf, batches, backend="gloo", timeout=300)
    assert [(r["cp"], r["dp"], r["ep"]) for r in ranks] == [(0, 0, 0), (1, 0, 1), (0, 1, 2), (1, 1, 3)]
    assert all(r["group"] == [0, 1, 2, 3] for r in ranks)  # one expert-parallel group over both batches
    hf_state = hf.state_dict()
    for r in ranks:
        ids, mask = batches[r["dp"]]
        torch.testing.assert_close(r["logits"], want_logits[r["dp"]], atol=1e-10, rtol=0)
        assert_equals_hf_per_sequence(hf, r["logits"], ids, mask, atol=2e-5, rtol=1e-5, what=f"rank {r['ep']} ")
        assert torch.equal(r["load"], want_load[:, r["ep"]:r["ep"] + 1])  # its expert: both batches' real tokens
        mine = expert_shard(want_grads, 4, ep_size=4, ep_rank=r["ep"])
        assert sorted(r["grads"]) == sorted(mine)
        for name, grad in mine.items():
            torch.testing.assert_close(r["grads"][name], grad, atol=1e-10, rtol=1e-10, msg=f"rank {r['ep']} {name}")
        loss, router = want_aux[r["dp"]]
        torch.testing.assert_close(r["aux"][0], loss, atol=1e-12, rtol=1e-12)
        peer = ranks[r["ep"] ^ 1]  # the other CP share of the same batch
        for name, grad in router.items():
            torch.testing.assert_close(r["aux"][1][name] + peer["aux"][1][name], grad, atol=1e-12, rtol=1e-10)
        assert sorted(r["state"]) == sorted(hf_state)
        assert all(torch.equal(r["state"][k], v) for k, v in hf_state.items())
    assert want_load.sum() == 2 * 2 * sum(mask.sum() for _, mask in batches)  # two MoE layers, top-2, no pad


def _tp_cp_ep_worker(rank: int, world: int, hf, batch):
    """TP=2 (+SP) x CP=2, EP=2 (ETP=TP's): Megatron-Core's expert grid puts all four ranks in one tensor-and-expert
    group; each rank routes its SP slice of its CP share."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=2, cp_size=2, ep_size=2)
    tp, cp, ep = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank(), ps.get_expert_model_parallel_rank()
    model = from_hf(hf, tp_size=2, tp_rank=tp, ep_size=2, ep_rank=ep, sequence_parallel=True)
    forward = make_forward("thd", tp_size=2, cp_size=2, cp_rank=cp, cp_group=ps.get_context_parallel_group(),
                           moe_aux_loss=True)
    load = expert_load(model, forward, *batch)
    with torch.no_grad():
        out = forward(model, *batch)
    ps.destroy_model_parallel()
    return dict(tp=tp, cp=cp, ep=ep, logits=out["logits"], aux=out["moe_aux_loss"], load=load)


def test_ep2_with_tp2_sp_and_cp2_routes_every_real_token_once():
    """TP=2 (+SP) x CP=2 with EP=2, four gloo processes, one batch: the TP ranks' vocabulary halves are the single
    process's logits; each rank's experts are handed the single process's load (every real token of both CP shares
    routed to them, no pad); every rank's aux loss is the whole batch's.  (Gradients under CP x EP are checked
    without TP, above.)"""
    from packfwd.testing import run_local

    hf = hf_model("qwen3_moe-norm")
    batch = ragged_batch()
    model = from_hf(hf)
    out = make_forward("thd", moe_aux_loss=True)(model, *batch)
    want_load = expert_load(model, make_forward("thd"), *batch)
    ranks = run_local(_tp_cp_ep_worker, 4, hf, batch, backend="gloo", timeout=300)
    by = {(r["tp"], r["cp"]): r for r in ranks}
    assert sorted(by) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for cp in (0, 1):
        logits = torch.cat([by[0, cp]["logits"], by[1, cp]["logits"]], dim=-1)
        torch.testing.assert_close(logits, out["logits"].detach(), atol=1e-10, rtol=0)
    for r in ranks:
        torch.testing.assert_close(r["aux"], out["moe_aux_loss"].detach(), atol=1e-12, rtol=1e-12)
        # an expert-parallel rank's two TP ranks run their shards of its experts on the same tokens: each is handed
        # every real token of both CP shares routed to those experts, and no pad
        assert torch.equal(r["load"], want_load[:, 2 * r["ep"]:2 * r["ep"] + 2])
    assert sorted(r["ep"] for r in ranks) == [0, 0, 1, 1]
    assert want_load.sum() == 2 * 2 * batch[1].sum()  # two MoE layers, top-2, no pad routed
