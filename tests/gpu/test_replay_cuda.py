"""Router replay on the GPU: what the CPU tests cannot show.

* No host sync added: a bf16 MoE model (grouped experts, device counts) runs forward and backward with
  ``routed_experts=`` and ``seqlens`` under ``set_sync_debug_mode("error")`` (the expert-id checks are
  ``torch._assert_async`` on CUDA), and recording adds none either.
* Batch invariance holds with replay as without it: under ``batch_invariant=True`` a target sequence's logits with
  its recorded experts replayed are bitwise the same alone and among other sequences.

    PYTHONPATH=. python -m pytest -q tests/gpu/test_replay_cuda.py
"""

from __future__ import annotations

import pytest
import torch

import packfwd as pf
from packfwd.forward import deterministic as det

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def moe_model():
    from tests.gpu.test_batch_invariance_cuda import model_of

    return model_of("moe")


def batch(lengths, seed=0, vocab=32000):
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    mask = torch.arange(s)[None] < torch.tensor(lengths)[:, None]
    ids = torch.randint(1, vocab, (len(lengths), s), generator=g).masked_fill(~mask, 0)
    return ids.cuda(), mask.cuda()


@needs_cuda
def test_replay_forward_and_backward_make_no_host_sync():
    from tests.gpu.test_forward_no_sync import no_sync

    model = moe_model().train()
    lengths = [97, 5, 300, 1, 64]
    ids, mask = batch(lengths)
    record = pf.make_forward("thd", record_routing=True)
    with torch.no_grad():
        routed = record(model, ids, mask, seqlens=lengths)["routed_experts"]
    assert (routed[mask] >= 0).all() and (routed[~mask] == -1).all()
    forward = pf.make_forward("thd")

    def step():
        model.zero_grad(set_to_none=True)
        out = forward(model, ids, mask, seqlens=lengths, routed_experts=routed)
        out.float().square().mean().backward()
        return out

    step()  # warm-up
    out = no_sync(step)
    assert out[mask].isfinite().all()
    routers = [m for m in model.modules() if type(m).__name__ == "PackedRouter"]
    assert routers and all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in routers)
    with torch.no_grad():
        again = no_sync(lambda: record(model, ids, mask, seqlens=lengths, routed_experts=routed))
    assert torch.equal(again["routed_experts"], routed)


@needs_cuda
def test_replayed_logits_are_batch_invariant():
    model = moe_model().eval()
    target_len, others = 200, [31, 500, 7, 1024]
    ids, mask = batch([target_len, *others], seed=1)
    with det.enabled(deterministic=False):
        forward = pf.make_forward("thd", batch_invariant=True, record_routing=True)
        with torch.no_grad():
            routed = forward(model, ids, mask)["routed_experts"]
            alone = forward(model, ids[:1, :target_len], mask[:1, :target_len],
                            routed_experts=routed[:1, :target_len])["logits"][0]
            for order in ([0, 1, 2, 3, 4], [4, 3, 0, 2, 1], [2, 0]):
                out = forward(model, ids[order], mask[order], routed_experts=routed[order])["logits"]
                row = order.index(0)
                got = out[row, :target_len]
                assert torch.equal(got, alone), f"order {order}: {(got != alone).sum()} values differ"
