"""The Triton planning kernel (``packfwd.ops.plan``, the CUDA planning path) against the torch planning path,
field by field, and the THD plans also against the layout rules of ``packfwd.layout.rules`` (the single
definition of the padded lengths and the CP zigzag, which a Triton kernel cannot call).

By Hypothesis over random masks (every pattern of ``tests/strategies.py``: holes, left and right padding, empty
rows), bool and integer masks, host ``seqlens``, tp 1..4, cp 1..4, every CP rank, ``seq_align`` None or a valid
multiple, each under the default block sizes and under tiny ones (so rows and batches span several blocks); on
the GPU also hand-made masks of rows longer than one block and batches of more rows than one block.  The torch
path is itself checked against per-sequence loops by the CPU tests.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``),
where a quarter of the profile's Hypothesis examples keeps it fast.  The layouts plan with the kernel only for
CUDA masks, so on the CPU the tests switch ``ops.plan.available`` on.  What the interpreter cannot show:
concurrency between programs (it runs them one after another), and the device-side check of wrong ``seqlens``
(a CUDA assert; GPU only, below).

    PYTHONPATH=. python -m pytest -q tests/gpu/test_plan_kernel.py
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from packfwd import plan_bshd, plan_thd, plan_unpad, position_ids
from packfwd.layout.rules import (
    chunk_size,
    default_seq_align,
    local_positions,
    padded_lengths,
    zigzag_owner,
)
from packfwd.ops import plan as _plan

from ..strategies import masks
from ._kernel_device import DEVICE, gpu_only, needs_kernels

pytestmark = needs_kernels
pytest.importorskip("triton")

EXAMPLES = settings.default.max_examples // (4 if DEVICE == "cpu" else 1)
TINY = {"block_b": 4, "block_s": 16, "num_warps": 1}

UNPAD_FIELDS = ["index", "inverse", "cu_seqlens", "max_seqlen", "total"]
BSHD_FIELDS = ["index", "inverse", "cu_seqlens", "width", "attention_mask"]
THD_FIELDS = ["index", "inverse", "cu_seqlens", "cu_seqlens_padded", "max_seqlen", "total_tokens", "local_tokens",
              "local_positions"]


def both(plan, tiny=False):
    """(kernel plan, torch plan) of the same call."""
    with pytest.MonkeyPatch.context() as m:
        if DEVICE == "cpu":  # the layouts plan with the kernel for CUDA masks only
            m.setattr(_plan, "available", lambda mask: mask.numel() > 0)
        else:
            assert _plan.available(torch.ones(1, 1, device="cuda"))
        if tiny:
            m.setattr(_plan, "CONFIG", TINY)
        launched = []
        m.setattr(_plan, "plan_rows", lambda *a, run=_plan.plan_rows, **k: launched.append(1) or run(*a, **k))
        fast = plan()
        assert launched or fast.source.mask.numel() == 0
    with pytest.MonkeyPatch.context() as m:
        m.setattr(_plan, "available", lambda mask: False)
        slow = plan()
    return fast, slow


def same(a, b, fields):
    for f in fields:
        x, y = getattr(a, f), getattr(b, f)
        assert (x == y) if not isinstance(x, torch.Tensor) else torch.equal(x, y), f


def rules_plan(mask, tp, cp, rank, align):
    """The THD plan written from the rules alone: (index, inverse, cu_seqlens_padded, positions)."""
    real = mask.ne(0)
    b, s = real.shape
    p = padded_lengths(real.sum(1), seq_align=align, tp_size=tp, cp_size=cp)
    cu_padded = torch.cat([p.new_zeros(1), p.cumsum(0)])
    total = int(cu_padded[-1])
    local = total // cp
    q = real.cumsum(1) - 1  # each real token's position in its sequence
    chunk = chunk_size(p, cp).clamp(min=1)[:, None]  # (rows without tokens have no chunks)
    owner, row = zigzag_owner(q, chunk, cp)
    dest = owner * local + (cu_padded[:-1] // cp)[:, None] + row
    inverse = torch.where(real, dest, -1).reshape(-1)
    index = torch.full((total,), -1, dtype=torch.long, device=mask.device)
    index[dest[real]] = torch.arange(b * s, device=mask.device)[real.reshape(-1)]
    return index, inverse, cu_padded.to(torch.int32), local_positions(cu_padded, local, cp, rank)


mask_kinds = st.sampled_from([torch.bool, torch.uint8, torch.int32, torch.int64])


@st.composite
def thd_parallel(draw):
    """(tp, cp, cp_rank, seq_align): every rank, and None or a valid alignment."""
    tp, cp = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    rank = draw(st.integers(0, cp - 1))
    unit = 2 * cp if cp > 1 else draw(st.integers(1, 4))
    align = draw(st.one_of(st.none(), st.integers(1, 3).map(lambda k: k * unit)))
    return tp, cp, rank, align


@settings(max_examples=EXAMPLES)
@given(mask=masks(max_b=6, max_s=40), kind=mask_kinds, host_seqlens=st.booleans(), tiny=st.booleans(),
       parallel=thd_parallel())
def test_thd_plans_equal_the_torch_path_and_the_rules(mask, kind, host_seqlens, tiny, parallel):
    tp, cp, rank, align = parallel
    mask = mask.to(DEVICE, kind)
    seqlens = mask.ne(0).sum(1).tolist() if host_seqlens else None
    fast, slow = both(lambda: plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=align,
                                       seqlens=seqlens), tiny)
    same(fast, slow, THD_FIELDS)
    assert torch.equal(position_ids(fast), position_ids(slow))
    index, inverse, cu_padded, positions = rules_plan(mask, tp, cp, rank, align or default_seq_align(cp))
    assert torch.equal(fast.index, index)
    assert torch.equal(fast.inverse, inverse)
    assert torch.equal(fast.cu_seqlens_padded, cu_padded)
    assert torch.equal(fast.local_positions, positions)


@settings(max_examples=EXAMPLES)
@given(mask=masks(max_b=6, max_s=40), kind=mask_kinds, host_seqlens=st.booleans(), tiny=st.booleans(),
       tp=st.integers(1, 4))
def test_unpad_and_bshd_plans_equal_the_torch_path(mask, kind, host_seqlens, tiny, tp):
    mask = mask.to(DEVICE, kind)
    seqlens = mask.ne(0).sum(1).tolist() if host_seqlens else None
    same(*both(lambda: plan_unpad(mask, seqlens=seqlens), tiny), UNPAD_FIELDS)
    same(*both(lambda: plan_bshd(mask, tp_size=tp, seqlens=seqlens), tiny), BSHD_FIELDS)


def long_masks(seed):
    """Masks of rows longer than one block of columns, and of more rows than one block of rows."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    for b, s in [(5, 1500), (300, 9), (2, 4096)]:
        lengths = torch.randint(0, s + 1, (b,), generator=g, device=DEVICE)
        cols = torch.arange(s, device=DEVICE)[None]
        yield cols < lengths[:, None]
        yield cols >= (s - lengths)[:, None]
        yield torch.rand(b, s, generator=g, device=DEVICE) < 0.5


@gpu_only
@pytest.mark.parametrize("tp, cp", [(1, 1), (2, 1), (1, 2), (2, 2), (3, 3)])
def test_long_rows_and_large_batches(tp, cp):
    for mask in long_masks(tp * 10 + cp):
        same(*both(lambda: plan_unpad(mask)), UNPAD_FIELDS)
        same(*both(lambda: plan_bshd(mask, tp_size=tp)), BSHD_FIELDS)
        for rank in range(cp):
            fast, slow = both(lambda: plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=rank))
            same(fast, slow, THD_FIELDS)
            index, inverse, cu_padded, positions = rules_plan(mask, tp, cp, rank, default_seq_align(cp))
            assert torch.equal(fast.index, index) and torch.equal(fast.local_positions, positions)


@gpu_only
def test_wrong_seqlens_are_caught_on_the_device():
    """A device-side assert ends the CUDA context, so this runs in its own process."""
    import subprocess
    import sys

    code = ("import torch; from packfwd import plan_thd; m = torch.ones(2, 8, dtype=torch.bool, device='cuda'); "
            "plan_thd(m, seqlens=[8, 7]); torch.cuda.synchronize(); print('not caught')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "not caught" not in proc.stdout
