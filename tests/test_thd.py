"""to_thd / from_thd against a plain per-sequence reference for every shape, mask pattern and (tp, cp, rank).

Strategy: the reference builds each rank's tensor by slicing padded sequences (tests/oracles.py); packfwd must
equal it bit for bit, and from_thd over all ranks must give back x with zeros at the pads.  A second reference,
written from verl's definition of its packing, must match packfwd with seq_align = 2*tp*cp (tp without CP).
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfwd import from_thd, plan_thd, position_ids, to_thd

from .oracles import ref_masked, ref_padded_lengths, ref_positions, ref_sequences, ref_thd_rank, ref_verl_layout
from .strategies import batches, parallel, random_tensor


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


def all_ranks(x, mask, tp, cp, **kw):
    outs, infos = zip(*(to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=r, **kw) for r in range(cp)))
    return list(outs), list(infos)


@given(batches(), parallel)
def test_to_thd_matches_reference_and_from_thd_inverts(batch, par):
    x, mask = batch
    tp, cp, rank = par
    y, info = to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=rank)
    assert same(y, ref_thd_rank(x, mask, tp, cp, rank))
    outs, _ = all_ranks(x, mask, tp, cp)
    assert same(from_thd(outs if cp > 1 else outs[0], info), ref_masked(x, mask))


@given(batches(dtypes=[torch.int64, torch.bfloat16]), parallel)
def test_metadata(batch, par):
    x, mask = batch
    tp, cp, rank = par
    info = plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=rank)
    lengths = [len(s) for s in ref_sequences(x, mask)]
    p = ref_padded_lengths(lengths, tp, cp, None)
    cum = lambda v: [sum(v[:i]) for i in range(len(v) + 1)]  # noqa: E731
    assert info.cu_seqlens.dtype == info.cu_seqlens_padded.dtype == torch.int32
    assert info.cu_seqlens.tolist() == cum(lengths)
    assert info.cu_seqlens_padded.tolist() == cum(p)
    assert info.max_seqlen == max(p, default=0) and isinstance(info.max_seqlen, int)
    assert info.total_tokens == sum(p) and info.local_tokens * cp == sum(p)
    # Megatron's constraints: padded lengths divide into 2*cp chunks, each rank's share divides by tp
    assert all(v % (2 * cp) == 0 for v in p) if cp > 1 else True
    assert info.local_tokens % tp == 0
    # padding per sequence is below the alignment, except the tail extension of the last sequence
    assert all(pl - n < (2 * cp if cp > 1 else 1) for pl, n in zip(p[:-1], lengths[:-1]))
    assert position_ids(info).tolist() == ref_positions(p, cp, rank)


@given(batches(dtypes=[torch.int64, torch.float32]), parallel)
def test_verl_alignment_reproduces_verl_layout(batch, par):
    x, mask = batch
    tp, cp, rank = par
    align = 2 * tp * cp if cp > 1 else tp
    y, info = to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=align)
    assert same(y, ref_verl_layout(x, mask, tp, cp, rank))
    lengths = [len(s) for s in ref_sequences(x, mask)]
    padded = [math.ceil(n / align) * align for n in lengths]
    assert info.cu_seqlens_padded.tolist() == [sum(padded[:i]) for i in range(len(padded) + 1)]


@pytest.mark.parametrize("length", [1, 2, 3, 7])
def test_short_sequences_under_wide_parallelism(length):
    """Sequences shorter than the alignment (even one token with cp=4, tp=8) pack and unpack exactly."""
    tp, cp = 8, 4
    mask = torch.zeros(3, 9, dtype=torch.bool)
    mask[0, :length] = True
    mask[1, -1] = True
    mask[2, 2 : 2 + length] = True
    x = random_tensor((3, 9, 2), torch.float32, length)
    for align in (None, 2 * tp * cp):
        outs, infos = all_ranks(x, mask, tp, cp, seq_align=align)
        for r in range(cp):
            assert same(outs[r], ref_thd_rank(x, mask, tp, cp, r, align))
        assert same(from_thd(outs, infos[0]), ref_masked(x, mask))


def test_default_alignment_pads_less_than_verl():
    lengths = [5, 17, 3, 30, 1, 12]
    mask = torch.zeros(len(lengths), 32, dtype=torch.bool)
    for i, n in enumerate(lengths):
        mask[i, :n] = True
    for tp, cp in [(2, 2), (4, 2), (8, 1), (8, 4)]:
        ours = plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=0).total_tokens
        verl = plan_thd(mask, tp_size=tp, cp_size=cp, cp_rank=0, seq_align=2 * tp * cp if cp > 1 else tp).total_tokens
        assert sum(lengths) <= ours <= verl
        assert ours < verl or tp == 1


@given(batches(max_b=5, max_s=24, dtypes=[torch.float32]), parallel, st.sampled_from([-1.0, 3.0]))
def test_from_thd_fill_value(batch, par, fill):
    x, mask = batch
    tp, cp, _ = par
    outs, infos = all_ranks(x, mask, tp, cp)
    assert same(from_thd(outs if cp > 1 else outs[0], infos[0], fill_value=fill), ref_masked(x, mask, fill))


def test_host_seqlens_give_the_same_plan():
    mask = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 0, 0, 0], [1, 0, 1, 0, 1]], dtype=torch.bool)
    a = plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1)
    b = plan_thd(mask, tp_size=2, cp_size=2, cp_rank=1, seqlens=[3, 5, 0, 3])
    for f in ("cu_seqlens", "cu_seqlens_padded", "gather_index", "zero_rows", "scatter_index", "local_positions"):
        assert torch.equal(getattr(a, f), getattr(b, f)), f
    assert (a.max_seqlen, a.local_tokens) == (b.max_seqlen, b.local_tokens)


def test_max_seqlen_override_is_reported_and_checked():
    mask = torch.ones(2, 6, dtype=torch.bool)
    assert plan_thd(mask, max_seqlen=64).max_seqlen == 64
    with pytest.raises(ValueError, match="max_seqlen"):
        plan_thd(mask, max_seqlen=3)


def test_packed_seq_params():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=torch.bool)
    info = plan_thd(mask, cp_size=2, cp_rank=0)
    psp = info.packed_seq_params()
    assert psp.qkv_format == "thd"
    assert psp.cu_seqlens_q.tolist() == psp.cu_seqlens_kv.tolist() == [0, 3, 7]
    assert psp.cu_seqlens_q_padded.tolist() == psp.cu_seqlens_kv_padded.tolist() == [0, 4, 8]
    assert psp.max_seqlen_q == psp.max_seqlen_kv == 4
