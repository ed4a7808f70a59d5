"""Host syncs on the GPU, caught by ``torch.cuda.set_sync_debug_mode``: applying any plan (forward and backward,
through the Triton op and through the torch path) makes none; planning with host ``seqlens`` makes none; planning
from a device mask makes exactly one; a whole packed forward and backward with ``seqlens`` makes none.

    PYTHONPATH=. python -m pytest -q tests/gpu
"""

import contextlib
import warnings

import pytest
import torch

from packfwd.ops import gather as _rows
from packfwd import (
    from_bshd,
    from_thd,
    pad,
    plan_bshd,
    plan_thd,
    plan_unpad,
    position_ids,
    to_bshd,
    to_thd,
    unpad,
)
from packfwd.layout.bucket import Bucket, plan_thd_bucket

from ._forward import forward, make_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B, S, H = 6, 96, 16
LENGTHS = [96, 1, 0, 50, 95, 7]


@contextlib.contextmanager
def sync_mode(mode):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)


def count_syncs(fn):
    """How many host syncs ``fn()`` makes (the debug mode warns once per sync)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with sync_mode("warn"):
            fn()
    return sum("synchronizing" in str(w.message).lower() for w in caught)


def mask_and_x(dtype=torch.float32, width=H):
    mask = torch.arange(S, device="cuda")[None] < torch.tensor(LENGTHS, device="cuda")[:, None]
    mask[3, :10] = False  # left padding and holes too
    mask[4, 40:45] = False
    x = torch.randn(B, S, width, device="cuda", dtype=dtype, requires_grad=True)
    return mask, x


@pytest.fixture(params=["kernel", "torch"])
def path(request, monkeypatch):
    if request.param == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setattr(_rows, "use_op", lambda src: True)
    else:
        monkeypatch.setattr(_rows, "use_op", lambda src: False)
    return request.param


def test_applying_plans_forward_and_backward_makes_no_sync(path):
    mask, x = mask_and_x()
    pu, pb = plan_unpad(mask), plan_bshd(mask, tp_size=2)
    thd = [plan_thd(mask, tp_size=2, cp_size=2, cp_rank=r) for r in range(2)]
    thd1 = plan_thd(mask, tp_size=4)
    bucket = plan_thd_bucket(mask, Bucket(tokens=1024, max_seqlen=128), tp_size=2)
    torch.cuda.synchronize()
    with sync_mode("error"):
        packed = unpad(x, pu)[0]
        outs = [to_thd(x, i)[0] for i in thd]
        y1 = to_thd(x, thd1)[0]
        yb = to_bshd(x, pb)[0]
        yk = to_thd(x, bucket)[0]
        total = (
            pad(packed * 2, pu, fill_value=-1).sum()
            + from_thd([o * 3 for o in outs], thd[0]).sum()
            + from_thd(y1, thd1).sum()
            + from_bshd(yb, pb).sum()
            + from_thd(yk, bucket).sum()
            + sum(position_ids(i).sum() for i in (*thd, thd1, bucket))
        )
        total.backward()
    torch.cuda.synchronize()
    assert x.grad.isfinite().all()


def test_planning_with_host_seqlens_makes_no_sync():
    mask, _ = mask_and_x()
    seqlens = mask.sum(1).tolist()
    torch.cuda.synchronize()
    with sync_mode("error"):
        plan_unpad(mask, seqlens=seqlens)
        plan_bshd(mask, tp_size=2, seqlens=seqlens)
        for cp in (1, 2, 3):
            for r in range(cp):
                plan_thd(mask, tp_size=2, cp_size=cp, cp_rank=r, seqlens=seqlens)
        plan_thd_bucket(mask, Bucket(tokens=1024, max_seqlen=128), cp_size=2, cp_rank=0, seqlens=seqlens)
        plan_thd(mask.int(), seqlens=seqlens)  # integer masks: values checked on the device
    torch.cuda.synchronize()


@pytest.mark.parametrize("kind", ["unpad", "bshd", "thd", "thd_cp2", "bucket", "int_mask"])
def test_planning_from_a_device_mask_makes_exactly_one_sync(kind):
    mask, _ = mask_and_x()
    plan = {
        "unpad": lambda: plan_unpad(mask),
        "bshd": lambda: plan_bshd(mask, tp_size=2),
        "thd": lambda: plan_thd(mask, tp_size=2),
        "thd_cp2": lambda: plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1),
        "bucket": lambda: plan_thd_bucket(mask, Bucket(tokens=1024, max_seqlen=128)),
        "int_mask": lambda: plan_thd(mask.to(torch.int64), cp_size=2, cp_rank=0),
    }[kind]
    plan()  # warm-up: first-use allocations
    assert count_syncs(plan) == 1


def test_counting_sees_a_sync():
    """The counter itself: an .item() is one sync."""
    t = torch.ones(3, device="cuda")
    assert count_syncs(lambda: t.sum().item()) == 1


@pytest.mark.parametrize("attention", [True, False])
def test_whole_packed_forward_and_backward_with_seqlens_makes_no_sync(attention):
    mask, x = mask_and_x(torch.bfloat16, width=128)
    seqlens = mask.sum(1).tolist()
    weights = [w.requires_grad_() for w in make_weights(128, "cuda")]
    forward(x, plan_thd(mask, seqlens=seqlens), weights, attention).sum().backward()  # warm-up
    torch.cuda.synchronize()
    with sync_mode("error"):
        info = plan_thd(mask, seqlens=seqlens)
        out = forward(x, info, weights, attention)
        out.float().sum().backward()
    torch.cuda.synchronize()
    assert out.isfinite().all()
