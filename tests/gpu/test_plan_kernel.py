"""The Triton planning kernel (CUDA planning path) against the torch planning path, field by field, for every mask
pattern, integer masks, host ``seqlens``, several tp/cp/rank/alignment choices, and rows longer than one block.
The torch path is itself checked against per-sequence loops by the CPU tests.

    PYTHONPATH=. python -m pytest -q tests/gpu
"""

import pytest
import torch

from packfwd import _plan_kernel, plan_bshd, plan_thd, plan_unpad, position_ids

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
pytest.importorskip("triton")


def masks(seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    for b, s in [(1, 1), (3, 7), (6, 33), (5, 1500), (300, 9), (2, 4096)]:
        lengths = torch.randint(0, s + 1, (b,), generator=g, device="cuda")
        cols = torch.arange(s, device="cuda")[None]
        yield "right", cols < lengths[:, None]
        yield "left", cols >= (s - lengths)[:, None]
        yield "holes", torch.rand(b, s, generator=g, device="cuda") < 0.5
        yield "empty", torch.zeros(b, s, dtype=torch.bool, device="cuda")
        yield "full", torch.ones(b, s, dtype=torch.bool, device="cuda")


def both(plan, monkeypatch):
    """(kernel plan, torch plan) of the same call."""
    assert _plan_kernel.available(torch.ones(1, 1, device="cuda"))
    fast = plan()
    with monkeypatch.context() as m:
        m.setattr(_plan_kernel, "available", lambda mask: False)
        slow = plan()
    return fast, slow


def same(a, b, fields):
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y), f


@pytest.mark.parametrize("seed", [0, 1])
def test_unpad_and_bshd_plans_equal_the_torch_path(seed, monkeypatch):
    for kind, mask in masks(seed):
        for m in (mask, mask.to(torch.uint8)):
            same(*both(lambda: plan_unpad(m), monkeypatch), ["index", "inverse", "cu_seqlens", "max_seqlen", "total"])
            for tp in (1, 4):
                same(*both(lambda: plan_bshd(m, tp_size=tp), monkeypatch),
                     ["index", "inverse", "cu_seqlens", "width", "attention_mask"])


@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 3)])
def test_thd_plans_equal_the_torch_path(tp, cp, monkeypatch):
    fields = ["index", "inverse", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "total_tokens", "local_tokens"]
    for kind, mask in masks(tp * 10 + cp):
        seqlens = mask.sum(1).tolist()
        for rank in range(cp):
            for align in (None, 2 * tp * cp if cp > 1 else tp):
                kw = dict(tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=align)
                for plan in (lambda: plan_thd(mask, **kw), lambda: plan_thd(mask, seqlens=seqlens, **kw),
                             lambda: plan_thd(mask.int(), **kw)):
                    fast, slow = both(plan, monkeypatch)
                    same(fast, slow, fields)
                    assert torch.equal(position_ids(fast), position_ids(slow)), (kind, tp, cp, rank, align)


def test_wrong_seqlens_are_caught_on_the_device():
    """A device-side assert ends the CUDA context, so this runs in its own process."""
    import subprocess
    import sys

    code = ("import torch; from packfwd import plan_thd; m = torch.ones(2, 8, dtype=torch.bool, device='cuda'); "
            "plan_thd(m, seqlens=[8, 7]); torch.cuda.synchronize(); print('not caught')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not caught" not in proc.stdout
