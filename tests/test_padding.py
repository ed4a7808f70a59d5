"""unpad / pad and sp_pad / sp_unpad against plain per-row loops, for every mask pattern, shape and dtype."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfwd import pad, plan_unpad, sp_pad, sp_unpad, unpad

from .oracles import ref_masked, ref_sequences, ref_unpad
from .strategies import batches, random_tensor


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit-for-bit equality, dtype and shape included (NaN-free data)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@given(batches())
def test_unpad_matches_loop_and_pad_inverts(batch):
    x, mask = batch
    packed, info = unpad(x, mask)
    assert same(packed, ref_unpad(x, mask))
    lengths = [len(s) for s in ref_sequences(x, mask)]
    assert info.cu_seqlens.tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert info.cu_seqlens.dtype == torch.int32
    assert info.max_seqlen == max(lengths, default=0)
    assert same(pad(packed, info), ref_masked(x, mask))


@given(batches(dtypes=[torch.float32, torch.int64]), st.sampled_from([-1, 7]))
def test_pad_fill_value(batch, fill):
    x, mask = batch
    packed, info = unpad(x, mask)
    assert same(pad(packed, info, fill_value=fill), ref_masked(x, mask, fill))


@given(batches(max_b=4, max_s=16))
def test_plan_once_apply_many(batch):
    x, mask = batch
    info = plan_unpad(mask)
    p1, _ = unpad(x, info)
    p2, _ = unpad(x.flip(0).flip(0) + 0 if x.dtype != torch.bool else x, info)
    assert same(p1, p2)
    assert same(p1, ref_unpad(x, mask))


def test_host_seqlens_plan_equals_synced_plan():
    mask = torch.tensor([[0, 1, 1, 0], [1, 1, 1, 1], [0, 0, 0, 0]], dtype=torch.bool)
    a, b = plan_unpad(mask), plan_unpad(mask, seqlens=[2, 4, 0])
    assert torch.equal(a.indices, b.indices) and a.max_seqlen == b.max_seqlen == 4


def test_inputs_are_not_mutated():
    x = random_tensor((3, 5, 2), torch.float32, 1)
    mask = torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    x0, m0 = x.clone(), mask.clone()
    packed, info = unpad(x, mask)
    packed0 = packed.clone()
    pad(packed, info)
    assert torch.equal(x, x0) and torch.equal(mask, m0) and torch.equal(packed, packed0)


@given(st.integers(0, 40), st.integers(1, 8), st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
def test_sp_pad_inverse(t, tp, dtype):
    x = random_tensor((t, 3), dtype, t)
    y = sp_pad(x, tp)
    assert y.shape[0] % tp == 0 and y.shape[0] - t < tp
    assert (y[t:] == 0).all()
    assert same(sp_unpad(y, t), x)


def test_sp_unpad_rejects_a_count_past_the_end():
    with pytest.raises(ValueError, match="num_tokens"):
        sp_unpad(torch.zeros(4), 5)
