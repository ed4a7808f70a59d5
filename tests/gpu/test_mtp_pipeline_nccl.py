"""Multi-token prediction across a real pipeline: PP=2 on two GPUs (NCCL), the MTP block and the embedding copy it
reads on the last stage, forward and backward through packfwd's point-to-point schedule, against the plain
per-sequence reference of ``tests/mtp_support.py`` (float32).  The gradient of the word embedding is the sum of the
first stage's and the last stage's copies (what Megatron-Core's embedding-group all-reduce adds up).

Run on a machine with 2 CUDA devices (skipped otherwise): ``python -m pytest -q tests/gpu/test_mtp_pipeline_nccl.py``.
"""

from __future__ import annotations

import pytest
import torch

from tests.mtp_support import ARGS, TOL, batch, build, grads, reference, test_loss

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)


def pp_rank(rank: int, world: int, state: dict) -> dict:
    from megatron.core import parallel_state as ps

    import packfwd as pf
    from packfwd.models import build_model
    from packfwd.models.convert.hf import load_weights
    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.parallel import pipeline_forward_backward

    ensure_model_parallel(pp_size=world)
    device = torch.device("cuda", torch.cuda.current_device())
    per_stage = ARGS.num_layers // world
    stage = build_model(ARGS, pp_rank=rank, pp_size=world, attention_backend="reference", init=False, device=device)
    own = {}
    for name, _ in stage.named_parameters():
        source = name
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            source = f"decoder.layers.{int(local) + rank * per_stage}.{rest}"
        own[name] = state[source].to(device)
    stage = load_weights(stage, own)
    ids, mask, loss_mask, weights = (x.to(device) for x in batch())
    forward = pf.make_forward("thd", mtp=True)
    outs = pipeline_forward_backward(
        [stage], lambda s, mb: forward(s, ids, mask, mtp_loss_mask=loss_mask), [0],
        pp_group=ps.get_pipeline_model_parallel_group(), loss_fn=lambda out, mb: test_loss(out, weights),
    )
    names = {}
    for name, g in grads(stage).items():
        if name.startswith("decoder.layers."):
            local, rest = name[len("decoder.layers."):].split(".", 1)
            name = f"decoder.layers.{int(local) + rank * per_stage}.{rest}"
        names[name] = g.float().cpu()
    ps.destroy_model_parallel()
    return {"grads": names, "out": None if outs is None else {k: v.cpu() for k, v in outs[0].items()},
            "has_mtp": hasattr(stage, "mtp") and stage.mtp is not None}


def test_pp2_mtp_on_the_last_stage_matches_the_per_sequence_reference():
    from packfwd.testing import run_local

    whole = build()
    state = {n: p.detach().clone() for n, p in whole.named_parameters()}
    first, last = run_local(pp_rank, 2, state, backend="nccl", timeout=600)
    ids, mask, loss_mask, weights = batch()
    want_logits, want_lp, want_loss = reference(whole, ids, mask, loss_mask)
    test_loss({"logits": want_logits, "mtp_log_probs": want_lp, "mtp_loss": want_loss}, weights).backward()
    want = grads(whole)
    assert first["out"] is None and not first["has_mtp"] and last["has_mtp"]
    torch.testing.assert_close(last["out"]["mtp_log_probs"], want_lp.detach(), **TOL)
    torch.testing.assert_close(last["out"]["mtp_loss"], want_loss.detach(), **TOL)
    torch.testing.assert_close(last["out"]["logits"], want_logits.detach(), **TOL)
    got = {}
    for rank in (first, last):
        for name, g in rank["grads"].items():
            got[name] = got[name] + g if name in got else g  # the embedding: both stages' copies
    assert got.keys() == want.keys(), set(got) ^ set(want)
    for name, g in want.items():
        torch.testing.assert_close(got[name], g, **GRAD_TOL, msg=name)
