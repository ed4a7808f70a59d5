"""Router replay on the GPU: what the CPU tests cannot show.

* No host sync added: a bf16 MoE model (grouped experts, device counts) runs forward and backward with
  ``routed_experts=`` and ``seqlens`` under ``set_sync_debug_mode("error")`` (the expert-id checks are
  ``torch._assert_async`` on CUDA), and recording adds none either.
* Batch invariance holds with replay as without it: under ``batch_invariant=True`` a target sequence's logits with
  its recorded experts replayed are bitwise the same alone and among other sequences.
* Records joined over pipeline stages (one process): the whole model's bit for bit, no host sync; a carried record
  with its ``-1`` misplaced trips the device assert (the last two tests: written 2026-12-06, not yet run on a GPU).

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


@needs_cuda
def test_stages_join_their_records_on_cuda_without_a_host_sync():
    """``record_routing=True`` on two pipeline stages in one process (bf16, CUDA): the last stage's record equals the
    whole model's bit for bit (same kernels, same shapes), and the later stage's check of the carried record (its
    ``-1`` exactly at this batch's pads: ``torch._assert_async``) adds no host sync when the counts are given."""
    from tests.gpu.test_forward_no_sync import no_sync
    from tests.test_parallel_families import moe_model as tiny_moe
    from tests.test_replay import run_stages

    from packfwd.models import from_hf

    hf = tiny_moe(layers=4)
    lengths = [37, 5, 120, 1]
    ids, mask = batch(lengths, vocab=hf.config.vocab_size)
    forward = pf.make_forward("thd", record_routing=True)
    whole = from_hf(hf, device="cuda", params_dtype=torch.bfloat16)
    stages = [from_hf(hf, pp_rank=r, pp_size=2, device="cuda", params_dtype=torch.bfloat16) for r in range(2)]
    with torch.no_grad():
        want = forward(whole, ids, mask, seqlens=lengths)["routed_experts"]
        run_stages(forward, stages, ids, mask, seqlens=lengths)  # warm-up
        got, handed = no_sync(lambda: run_stages(forward, stages, ids, mask, seqlens=lengths))
    assert torch.equal(got["routed_experts"], want), "the stages' joined record is the whole model's"
    assert (want[~mask] == -1).all() and (want[mask] >= 0).all()


@needs_cuda
def test_a_misplaced_carried_record_trips_the_device_assert():
    """A carried record whose ``-1`` are not this batch's pads (another micro-batch's, same token count) is caught
    on the device (``torch._assert_async``): run in a child process, since a device assert ends the CUDA context."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import torch, packfwd as pf
        from packfwd.models import from_hf
        from tests.test_parallel_families import moe_model
        from tests.gpu.test_replay_cuda import batch
        hf = moe_model(layers=4)
        ids, mask = batch([9, 4, 3], vocab=hf.config.vocab_size)
        forward = pf.make_forward("bshd", record_routing=True)
        stages = [from_hf(hf, pp_rank=r, pp_size=2, device="cuda", params_dtype=torch.bfloat16) for r in range(2)]
        with torch.no_grad():
            hidden, record = forward(stages[0], ids, mask)
            moved = torch.roll(record, 1, dims=0)  # the same shape, the -1 rows elsewhere
            stages[1].set_input_tensor(hidden)
            forward(stages[1], ids, mask, recorded_routing=moved)
            torch.cuda.synchronize()
        print("NOT CAUGHT")
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert "NOT CAUGHT" not in done.stdout and done.returncode != 0, (done.stdout[-2000:], done.stderr[-2000:])
    assert "device-side assert" in done.stderr, done.stderr[-2000:]  # the device check, not an eager refusal
