"""Expert parallelism (EP=2 over gloo): each rank holds half the experts and a batch of its own shape.

Expert-parallel ranks are data-parallel ranks: rank 0 runs a [4, 9] ragged batch, rank 1 a [3, 6] one (fewer
tokens: its dispatcher pads them to rank 0's count).  Each rank's logits equal transformers run on each of its
sequences alone, and the single-process model's on the same batch; the expert weights' gradients on each rank
equal the single-process model's gradients of the loss summed over both batches (nothing to all-reduce: each
expert lives on one rank), the other weights' after the data-parallel all-reduce; the experts' load counts real
tokens only; ``to_hf_state_dict`` gathers the experts back bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import from_hf, to_hf_state_dict
from packfwd.models.hf_moe import expert_shard
from tests.oracles import assert_equals_hf_per_sequence
from tests.test_moe import V, expert_load, hf_model, ragged_batch


def small_batch(seed: int = 1):
    """ids [3, 6]: lengths 6, 2 (left-padded), 4 (right-padded)."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(3, 6, dtype=torch.bool)
    mask[0], mask[1, 4:], mask[2, :4] = True, True, True
    return torch.randint(1, V, (3, 6), generator=g).masked_fill(~mask, 0), mask


def loss_of(logits, rank: int):
    """A loss that weighs every logit differently (fixed per rank)."""
    g = torch.Generator().manual_seed(100 + rank)
    return (logits * torch.randn(logits.shape, generator=g, dtype=logits.dtype)).sum()


def _ep_worker(rank: int, world: int, hf, batches):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.cpu import host_collectives
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
                refused=refused)


def test_ep2_ranks_with_batches_of_their_own_shape_equal_one_process():
    from packfwd.testing import run_local

    hf = hf_model("qwen3_moe-norm")
    batches = [ragged_batch(), small_batch()]
    model = from_hf(hf)
    want_logits, want_load, total = [], 0, 0
    for rank, (ids, mask) in enumerate(batches):
        logits = make_forward("thd")(model, ids, mask)
        want_logits.append(logits.detach())
        total = total + loss_of(logits, rank)
        want_load = want_load + expert_load(model, make_forward("thd"), ids, mask)
    total.backward()
    want_grads = {n: p.grad for n, p in model.named_parameters()}

    ranks = run_local(_ep_worker, 2, hf, batches, backend="gloo", timeout=300)
    for rank, ((ids, mask), got) in enumerate(zip(batches, ranks)):
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
    from packfwd.models.gpt import _check_expert_parallel
    from packfwd.models.hf import args_from_hf_config
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    args = args_from_hf_config(hf_model("qwen3_moe-norm").config)
    with pytest.raises(ValueError, match="num_experts=4 does not split over ep_size=3"):
        _check_expert_parallel(args, 3, 1, 1)
    with pytest.raises(NotImplementedError, match="ep_size=2 with tp_size=2, cp_size=1, pp_size=1"):
        _check_expert_parallel(args, 2, 2, 1)
    assert _check_expert_parallel(args, 1, 2, 2) == 1
    with pytest.raises(ValueError, match="ep_size=2, ep_rank=2 for 4 experts"):
        expert_shard({}, 4, ep_size=2, ep_rank=2)
