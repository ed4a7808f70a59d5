"""The MoE combine's ordered slot sum (``packfwd.ops.slot_sum``): the Triton kernel against a float64 loop over a
token's slots and against the torch reference, bit for bit (the same IEEE adds in the same order; in bf16 / fp16
on the GPU, and in float32 / float64 in Triton's interpreter, whose float32 -> bf16 cast truncates).  An invalid
slot pointing at a NaN row adds nothing; ``k`` 1 to 8, ``h`` not a power of 2 and wider than a column block, a
strided ``rows``, no tokens, no rows; bad arguments raise.

Runs on a CUDA GPU, or on the CPU in Triton's interpreter (``TRITON_INTERPRET=1``; see ``_kernel_device``).

    TRITON_INTERPRET=1 PYTHONPATH=. python -m pytest -q tests/gpu/test_slot_sum_kernel.py
"""

import pytest
import torch

from packfwd.ops import slot_sum as K

from ._kernel_device import DEVICE, needs_kernels

pytestmark = [needs_kernels]
triton = pytest.importorskip("triton")

# bf16 / fp16 bitwise only where the cast rounds to nearest (the GPU); the interpreter truncates
BITWISE = [torch.float32, torch.float64] + ([torch.bfloat16, torch.float16] if DEVICE == "cuda" else [])


def case(t, k, n, h, dtype, seed=0, invalid=0.3):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(n, h, generator=g, dtype=torch.float64).to(dtype)
    picked = torch.randint(0, max(n, 1), (t, k), generator=g)
    valid = torch.rand(t, k, generator=g) > invalid
    if n:
        rows[picked[~valid]] = float("nan")  # what an invalid slot points at is never read
        rows[picked[valid]] = torch.randn(int(valid.sum()), h, generator=g, dtype=torch.float64).to(dtype)
    return rows.to(DEVICE), picked.to(DEVICE), valid.to(DEVICE)


def loop(rows, picked, valid):
    """A token's valid rows added one at a time from +0.0, in float32 (float64 for float64), rounded once."""
    acc_dtype = torch.float64 if rows.dtype == torch.float64 else torch.float32
    r, p, v = rows.cpu().to(acc_dtype), picked.cpu(), valid.cpu()
    out = torch.zeros(p.shape[0], rows.shape[1], dtype=acc_dtype)
    for i in range(p.shape[0]):
        acc = torch.zeros(rows.shape[1], dtype=acc_dtype)
        for j in range(p.shape[1]):
            if v[i, j]:
                acc = acc + r[p[i, j]]
        out[i] = acc
    return out.to(rows.dtype)


@pytest.mark.parametrize("dtype", BITWISE, ids=str)
@pytest.mark.parametrize("t,k,n,h", [(1, 1, 1, 1), (7, 2, 9, 5), (13, 8, 40, 37), (5, 4, 11, 1500)])
def test_kernel_is_the_loop_and_the_reference_bit_for_bit(t, k, n, h, dtype):
    rows, picked, valid = case(t, k, n, h, dtype, seed=t + k)
    got = K.launch(rows, picked, valid)
    assert got.shape == (t, h) and got.dtype == dtype and torch.isfinite(got).all()
    assert torch.equal(got.cpu(), loop(rows, picked, valid))
    assert torch.equal(got, K.reference(rows, picked, valid))
    assert torch.equal(got, K.launch(rows, picked, valid))  # run to run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_half_types_sum_in_float32_and_round_once(dtype):
    """In the interpreter (truncating casts) within one unit of the last place of the float32 sum."""
    rows, picked, valid = case(9, 8, 30, 70, dtype, seed=5)
    got = K.launch(rows, picked, valid).double().cpu()
    want = loop(rows.float(), picked, valid).double()
    ulp = {torch.bfloat16: 2**-7, torch.float16: 2**-10}[dtype]
    assert bool(((got - want).abs() <= ulp * want.abs() + 1e-6).all())


def test_strided_rows_no_tokens_and_no_rows():
    rows, picked, valid = case(6, 3, 10, 8, torch.float32, seed=1)
    wide = torch.zeros(10, 20, device=DEVICE)
    wide[:, 4:12] = rows
    assert torch.equal(K.launch(wide[:, 4:12], picked, valid), K.reference(rows, picked, valid))
    empty = K.launch(rows, picked[:0], valid[:0])
    assert empty.shape == (0, 8)
    none = K.launch(rows[:0], picked.zero_(), valid.zero_())
    assert torch.equal(none, torch.zeros(6, 8, device=DEVICE))


def test_bad_arguments_raise():
    rows, picked, valid = case(3, 2, 4, 4, torch.float32)
    with pytest.raises(ValueError, match="picked must be an int64"):
        K.slot_sum(rows, picked.int(), valid)
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        K.slot_sum(rows, picked, valid.int())
    with pytest.raises(ValueError, match="rows must be a floating-point"):
        K.slot_sum(rows.long(), picked, valid)
