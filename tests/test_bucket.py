"""Fixed-bucket THD plans against a per-sequence loop built from the documented layout: the batch's sequences
padded to the alignment, then spare sequences of ``max_seqlen`` (the last one partial, the unused ones empty)
holding the slack up to ``bucket.tokens``; each padded sequence cut into the CP zigzag.  Also: every tensor's shape
depends on the bucket only, and ``copy_plan_`` turns one batch's plan into another's, field by field, without
writing into the caller's mask; an ordinary plan's results are fixed when it is made (the mask may change after)."""

import dataclasses
import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfwd import from_bshd, from_thd, pad, plan_bshd, plan_thd, plan_unpad, position_ids, to_bshd, to_thd, unpad
from packfwd.layout.bucket import Bucket, _clone, copy_plan_, plan_thd_bucket

from .oracles import ref_masked, ref_positions, ref_sequences
from .strategies import batches, parallel, random_tensor


def ref_bucket_layout(lengths, bucket, tp, cp):
    """Padded lengths of the real sequences and the spares, from the module docstring's rule."""
    align = 2 * cp if cp > 1 else 1
    p = [math.ceil(n / align) * align for n in lengths]
    slack = bucket.tokens - sum(p)
    spares = []
    for _ in range(math.ceil(bucket.tokens / bucket.max_seqlen)):
        spares.append(min(slack, bucket.max_seqlen))
        slack -= spares[-1]
    return p, spares


def ref_bucket_rank(x, mask, p, spares, cp, rank):
    """This rank's tensor: each padded sequence (real tokens, then zeros) cut into 2*cp chunks, chunks rank and
    2*cp-1-rank kept; spares are zeros."""
    parts = []
    for seq, pl in list(zip(ref_sequences(x, mask), p)) + [(x.new_zeros((0, *x.shape[2:])), s) for s in spares]:
        padded = torch.zeros((pl, *x.shape[2:]), dtype=x.dtype)
        padded[: len(seq)] = seq
        if cp == 1:
            parts.append(padded)
        elif pl:
            chunks = padded.chunk(2 * cp)
            parts += [chunks[rank], chunks[2 * cp - 1 - rank]]
    return torch.cat(parts) if parts else x.new_zeros((0, *x.shape[2:]))


def cumsum0(v):
    out = [0]
    for n in v:
        out.append(out[-1] + n)
    return out


def fitting_bucket(lengths, tp, cp, extra, max_extra):
    """The smallest valid bucket for these lengths plus ``extra`` units of slack."""
    align = 2 * cp if cp > 1 else 1
    unit = math.lcm(align, tp * cp)
    need = sum(math.ceil(n / align) * align for n in lengths)
    tokens = max(unit, (-(-need // unit) + extra) * unit)
    longest = max([math.ceil(n / align) * align for n in lengths], default=0)
    max_seqlen = max(align, -(-longest // align) * align + max_extra * align)
    return Bucket(tokens=tokens, max_seqlen=max_seqlen)


@given(batches(max_b=6, max_s=24, dtypes=[torch.float32, torch.int64, torch.bfloat16]), parallel, st.integers(0, 3),
       st.integers(0, 3))
def test_bucket_layout_matches_loop_on_every_rank(batch, par, extra, max_extra):
    x, mask = batch
    tp, cp, _ = par
    lengths = mask.sum(1).tolist()
    bucket = fitting_bucket(lengths, tp, cp, extra, max_extra)
    p, spares = ref_bucket_layout(lengths, bucket, tp, cp)
    outs = []
    for rank in range(cp):
        info = plan_thd_bucket(mask, bucket, tp_size=tp, cp_size=cp, cp_rank=rank)
        y, _ = to_thd(x, info)
        assert torch.equal(y, ref_bucket_rank(x, mask, p, spares, cp, rank))
        assert info.local_tokens * cp == bucket.tokens == info.total_tokens
        assert info.max_seqlen == bucket.max_seqlen
        assert info.cu_seqlens_padded.tolist() == cumsum0(p + spares)
        assert info.cu_seqlens.tolist() == cumsum0(lengths + [0] * len(spares))
        assert position_ids(info).tolist() == ref_positions(p + spares, cp, rank)
        outs.append(y)
    back = from_thd(outs if cp > 1 else outs[0], info, fill_value=-1)
    assert torch.equal(back, ref_masked(x, mask, -1))


@given(st.integers(0, 2**16), parallel)
def test_shapes_depend_on_the_bucket_only_and_copy_plan_switches_batches(seed, par):
    tp, cp, rank = par
    g = torch.Generator().manual_seed(seed)
    b, s = 5, 20
    masks = [torch.arange(s)[None] < torch.randint(0, s + 1, (b,), generator=g)[:, None] for _ in range(3)]
    align = 2 * cp if cp > 1 else 1
    unit = math.lcm(align, tp * cp)
    bucket = Bucket(tokens=-(-(b * (s + align)) // unit) * unit, max_seqlen=-(-(s + align) // align) * align)
    plans = [plan_thd_bucket(m, bucket, tp_size=tp, cp_size=cp, cp_rank=rank) for m in masks]
    static = _clone(plans[0])
    static.local_positions  # computed before the copies: copy_plan_ must keep it current
    for m, plan in zip(masks, plans):
        x = random_tensor((b, s, 3), torch.float32, seed)
        copy_plan_(static, plan)
        assert torch.equal(to_thd(x, static)[0], to_thd(x, plan)[0])
        assert torch.equal(position_ids(static), position_ids(plan))
        assert torch.equal(static.cu_seqlens_padded, plan.cu_seqlens_padded)
        ys = [to_thd(x, plan_thd_bucket(m, bucket, tp_size=tp, cp_size=cp, cp_rank=r))[0] for r in range(cp)]
        assert torch.equal(from_thd(ys if cp > 1 else ys[0], static), ref_masked(x, m))


def test_gradients_are_zero_at_padding_and_spares():
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    bucket = Bucket(tokens=16, max_seqlen=8)
    infos = [plan_thd_bucket(mask, bucket, cp_size=2, cp_rank=r) for r in range(2)]
    x = torch.randn(2, 4, 3, requires_grad=True)
    sum(to_thd(x, i)[0].sum() for i in infos).backward()
    assert torch.equal(x.grad, mask[..., None].float().expand(2, 4, 3))  # each real token once, pads never
    ys = [torch.randn(8, 3, requires_grad=True) for _ in range(2)]
    from_thd(ys, infos[0]).sum().backward()
    # rank 0 holds a0 . | b0 . | spare | spare ; rank 1 holds a1 a2 | . . | spare | spare  (chunks of 1, 1, 2, 2)
    real = [[1, 0, 1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0, 0, 0]]
    for y, r in zip(ys, real):
        assert torch.equal(y.grad, torch.tensor(r, dtype=torch.float32)[:, None].expand(8, 3))


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(bucket=Bucket(tokens=6, max_seqlen=8)), "needs 8 padded tokens but the bucket holds 6"),
        (dict(bucket=Bucket(tokens=10, max_seqlen=8), cp_size=2), "multiple of 4"),
        (dict(bucket=Bucket(tokens=16, max_seqlen=6), cp_size=2), "max_seqlen=6 must be a multiple"),
        (dict(bucket=Bucket(tokens=16, max_seqlen=4)), "below the longest padded sequence"),
        (dict(bucket=(16, 8)), "must be a packfwd.layout.bucket.Bucket"),
    ],
)
def test_errors_name_the_fix(kwargs, words):
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    with pytest.raises((ValueError, TypeError), match=words):
        plan_thd_bucket(mask, **kwargs)


def test_copy_plan_rejects_plans_of_another_bucket():
    mask = torch.ones(2, 4, dtype=torch.bool)
    a = plan_thd_bucket(mask, Bucket(tokens=16, max_seqlen=8))
    b = plan_thd_bucket(mask, Bucket(tokens=24, max_seqlen=8))
    with pytest.raises(ValueError, match="same bucket"):
        copy_plan_(a, b)
    with pytest.raises(ValueError, match="tokens"):
        Bucket(tokens=0, max_seqlen=8)


def _tensor_fields(plan, where="plan"):
    """Every tensor of a plan by its dotted name (the source's included)."""
    out = {}
    for f in dataclasses.fields(plan):
        v = getattr(plan, f.name)
        if isinstance(v, torch.Tensor):
            out[f"{where}.{f.name}"] = v
        elif dataclasses.is_dataclass(v):
            out.update(_tensor_fields(v, f"{where}.{f.name}"))
    return out


@pytest.mark.parametrize("dtype", [torch.bool, torch.int64])
def test_copy_plan_never_writes_into_the_callers_mask(dtype):
    # A bucket plan used as the captured plan (copy_plan_'s doctest does so) must own every tensor copy_plan_
    # writes into: before, a bool mask was held by reference and copy_plan_ overwrote it with the next batch's.
    bucket = Bucket(tokens=16, max_seqlen=8)
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=dtype)
    before = mask.clone()
    captured = plan_thd_bucket(mask, bucket)
    new_mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=dtype)
    new = plan_thd_bucket(new_mask, bucket)
    assert copy_plan_(captured, new) is captured
    assert torch.equal(mask, before)  # the caller's input is unchanged
    got, want = _tensor_fields(captured), _tensor_fields(new)
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), name
    for f in dataclasses.fields(new):  # ints: equal, but the documented exception source.total (the data's count)
        if not isinstance(getattr(new, f.name), torch.Tensor) and not dataclasses.is_dataclass(getattr(new, f.name)):
            assert getattr(captured, f.name) == getattr(new, f.name), f.name
    assert captured.source.total == 5 and new.source.total == 6
    assert torch.equal(to_thd(torch.arange(8).view(2, 4), captured)[0], to_thd(torch.arange(8).view(2, 4), new)[0])


def test_no_bucket_plan_shares_memory_with_its_inputs():
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]], dtype=torch.bool)
    info = plan_thd_bucket(mask, Bucket(tokens=16, max_seqlen=8), seqlens=[3, 2])
    for name, t in _tensor_fields(info).items():
        assert t.untyped_storage().data_ptr() != mask.untyped_storage().data_ptr(), name


def test_copy_plan_takes_only_bucket_plans():
    # an ordinary plan holds the caller's bool mask (and a nested tensor's offsets) by reference: never a target
    mask = torch.ones(2, 4, dtype=torch.bool)
    with pytest.raises(TypeError, match="plan_thd_bucket"):
        copy_plan_(plan_thd(mask), plan_thd(mask))


@pytest.mark.parametrize("dtype", [torch.bool, torch.int32])
@pytest.mark.parametrize("layout", ["thd", "unpad", "bshd"])
def test_an_ordinary_plan_is_fixed_at_planning_when_the_mask_changes_after(layout, dtype):
    # The promise (packfwd.layout.source.TokenSource.mask): a plan's transforms never read the mask after planning,
    # so mutating it afterwards changes nothing they compute (source.mask itself may be the caller's tensor).
    mask = torch.tensor([[1, 1, 1, 0], [0, 1, 1, 0], [1, 0, 0, 0]], dtype=dtype)
    x = torch.arange(1, 13).view(3, 4)
    make, pack, unpack = {
        "thd": (lambda m: plan_thd(m, tp_size=2), to_thd, from_thd),
        "unpad": (plan_unpad, unpad, pad),
        "bshd": (plan_bshd, to_bshd, from_bshd),
    }[layout]
    info, fresh = make(mask), make(mask.clone())
    mask.copy_(mask == 0)  # every entry flipped
    y = pack(x, info)[0]
    assert torch.equal(y, pack(x, fresh)[0])
    assert torch.equal(unpack(y, info), unpack(y, fresh))
    for name, t in _tensor_fields(fresh).items():
        if name != "plan.source.mask":
            assert torch.equal(_tensor_fields(info)[name], t), name
