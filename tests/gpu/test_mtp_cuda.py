"""Multi-token prediction on the GPU, with the GPU machine's Megatron-Core (0.19: another MTP layer API than the
CPU suite's 0.16): the model builds Megatron-Core's MTP block from packfwd's spec, and ``make_forward(...,
mtp=True)`` gives the per-sequence reference's per-depth log-probs and loss (``tests/mtp_support.py``) in float32
(reference attention; ``atol=rtol=1e-4``) and in bfloat16 with the CUDA varlen kernel (``atol=0.1`` on
log-probs, against the float32 reference), with no host sync when the lengths are given; and the verl drop-in
tests (``tests/test_verl_mtp.py``) run on the CPU with this Megatron-Core when verl is installed.

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_mtp_cuda.py tests/test_mtp.py tests/test_verl_mtp.py
"""

from __future__ import annotations

import pytest
import torch

import packfwd as pf

from ..mtp_support import ARGS, TIED, batch, build, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _cuda_batch():
    ids, mask, loss_mask, _ = batch()
    return ids.cuda(), mask.cuda(), loss_mask.cuda()


@pytest.mark.parametrize("args", [ARGS, TIED], ids=["untied", "tied"])
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_float32_matches_the_reference(data_format, args):
    model = build(args, device="cuda")
    ids, mask, loss_mask = _cuda_batch()
    with torch.no_grad():
        _, want_lp, want_loss = reference(model, ids, mask, loss_mask)
        out = pf.make_forward(data_format, mtp=True, seq_align=4 if data_format == "thd" else None)(
            model, ids, mask, mtp_loss_mask=loss_mask)
    torch.testing.assert_close(out["mtp_log_probs"], want_lp, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(out["mtp_loss"], want_loss, atol=1e-4, rtol=1e-4)


def test_bfloat16_varlen_kernel_close_to_the_reference_without_syncs():
    from packfwd.models import build_model

    torch.manual_seed(0)
    fp32 = build_model(ARGS, device="cuda", attention_backend="reference")
    bf16 = build_model(ARGS, device="cuda", params_dtype=torch.bfloat16)
    with torch.no_grad():
        for p, q in zip(bf16.parameters(), fp32.parameters()):
            p.copy_(q)
    ids, mask, loss_mask = _cuda_batch()
    seqlens = mask.sum(1).tolist()
    forward = pf.make_forward("thd", mtp=True)
    with torch.no_grad():
        _, want_lp, _ = reference(fp32, ids, mask, loss_mask)
        forward(bf16, ids, mask, seqlens=seqlens, mtp_loss_mask=loss_mask)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            out = forward(bf16, ids, mask, seqlens=seqlens, mtp_loss_mask=loss_mask)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out["mtp_log_probs"], want_lp, atol=0.1, rtol=0.05)
