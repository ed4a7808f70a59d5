"""to_bshd / from_bshd, next_token_labels and jagged nested input, against plain loops."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from packfwd import from_bshd, from_thd, next_token_labels, pad, to_bshd, to_thd, unpad

from .oracles import ref_masked, ref_next_token_labels, ref_sequences, ref_thd_rank
from .strategies import batches, parallel, random_tensor


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@given(batches(), st.integers(1, 8))
def test_bshd_left_aligns_each_row(batch, tp):
    x, mask = batch
    y, info = to_bshd(x, mask, tp_size=tp)
    seqs = ref_sequences(x, mask)
    width = -(-max((len(s) for s in seqs), default=0) // tp) * tp
    assert y.shape == (x.shape[0], width, *x.shape[2:])
    for i, s in enumerate(seqs):
        assert torch.equal(y[i, : len(s)], s)
        assert (y[i, len(s) :] == 0).all()
        assert info.attention_mask[i].tolist() == [k < len(s) for k in range(width)]
    assert same(from_bshd(y, info), ref_masked(x, mask))


@given(batches(dtypes=[torch.int64]))
def test_next_token_labels_match_loop(batch):
    x, mask = batch
    ids = x[(...,) + (0,) * (x.dim() - 2)]
    assert same(next_token_labels(ids, mask), ref_next_token_labels(ids, mask))


@given(batches(min_b=1, dtypes=[torch.int64]), parallel)
def test_labels_never_cross_sequences_after_packing(batch, par):
    """Packed with any CP split, each token's label is the next token of its own sequence."""
    x, mask = batch
    tp, cp, rank = par
    ids = x[(...,) + (0,) * (x.dim() - 2)]
    labels = next_token_labels(ids, mask, ignore_index=-1)
    ids_t, info = to_thd(ids, mask, tp_size=tp, cp_size=cp, cp_rank=rank)
    lab_t, _ = to_thd(labels, info)
    seqs = ref_sequences(ids, mask)
    pos = info.local_positions.tolist()
    seq_of = torch.repeat_interleave(torch.arange(len(seqs)), (info.cu_seqlens_padded.diff() // cp).long()).tolist()
    for j, (sq, q) in enumerate(zip(seq_of, pos)):
        s = seqs[sq]
        if q + 1 < len(s):
            assert lab_t[j] == s[q + 1]
        elif q < len(s):
            assert lab_t[j] == -1  # last real token of its sequence
        else:
            assert lab_t[j] == 0  # padding slot holds the pad value


def nested_of(seqs):
    return torch.nested.nested_tensor(seqs, layout=torch.jagged)


@given(st.lists(st.integers(1, 20), min_size=1, max_size=6), parallel, st.integers(0, 99))
def test_nested_input_to_thd_and_back(lengths, par, seed):
    tp, cp, rank = par
    seqs = [random_tensor((n, 3), torch.float32, seed + i) for i, n in enumerate(lengths)]
    nt = nested_of(seqs)
    # the same batch, padded
    s = max(lengths)
    x = torch.zeros(len(seqs), s, 3)
    mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    for i, q in enumerate(seqs):
        x[i, : len(q)], mask[i, : len(q)] = q, True
    y, info = to_thd(nt, tp_size=tp, cp_size=cp, cp_rank=rank)
    assert same(y, ref_thd_rank(x, mask, tp, cp, rank))
    outs = [to_thd(nt, tp_size=tp, cp_size=cp, cp_rank=r)[0] for r in range(cp)]
    back = from_thd(outs if cp > 1 else outs[0], info)
    assert back.is_nested
    for a, b in zip(back.unbind(), seqs):
        assert torch.equal(a, b)


def test_nested_rejects_a_mask():
    nt = nested_of([torch.ones(2, 3), torch.ones(4, 3)])
    with pytest.raises(ValueError, match="attention_mask=None"):
        to_thd(nt, torch.ones(2, 4, dtype=torch.bool))


def test_nested_unpad_is_its_values():
    seqs = [random_tensor((n, 2), torch.float32, n) for n in (3, 1, 4)]
    nt = nested_of(seqs)
    packed, info = unpad(nt, None)
    assert torch.equal(packed, torch.cat(seqs))
    assert info.cu_seqlens.tolist() == [0, 3, 4, 8] and info.max_seqlen == 4
    assert all(torch.equal(a, b) for a, b in zip(pad(packed, info).unbind(), seqs))


def _jagged(values, offsets):
    return torch.nested.nested_tensor_from_jagged(values, offsets=torch.tensor(offsets))


def test_a_nested_tensor_of_other_rows_is_refused_by_a_nested_plan():
    """Hazard: a nested x was packed with another nested tensor's plan by its values alone: one token more was
    dropped, other row lengths moved tokens into the wrong sequences, silently."""
    a = _jagged(torch.arange(10), [0, 3, 10])
    _, info = to_thd(a, seq_align=4)
    with pytest.raises(ValueError, match="2 rows and 11 tokens but the plan was made for 2 rows and 10 tokens"):
        to_thd(_jagged(torch.arange(11), [0, 3, 11]), info)
    with pytest.raises(ValueError, match="offsets differ"):  # the same token count, other boundaries
        to_thd(_jagged(torch.arange(10), [0, 4, 10]), info)
    same = _jagged(torch.arange(10) * 10, [0, 3, 10])  # equal offsets in another tensor: accepted
    assert torch.equal(to_thd(same, info)[0], to_thd(a, info)[0] * 10)


def test_a_narrowed_nested_tensor_is_refused_and_its_contiguous_copy_packs_its_tokens():
    """Hazard: torch.nested.narrow's view (gaps between rows, lengths() set) was packed from values(), gaps and
    all (every token of the padded source), or crashed deep inside the planning."""
    ids = torch.arange(1, 31).reshape(5, 6)
    starts, lengths = torch.tensor([0, 1, 2, 0, 3]), torch.tensor([6, 2, 4, 1, 3])
    view = torch.nested.narrow(ids, 1, starts, lengths, layout=torch.jagged)
    with pytest.raises(ValueError, match=r"narrowed view .* pass x.contiguous\(\)"):
        to_thd(view)
    want = torch.cat([ids[i, s:s + n] for i, (s, n) in enumerate(zip(starts.tolist(), lengths.tolist()))])
    assert torch.equal(to_thd(view.contiguous())[0], want)


def test_a_nested_plan_applies_under_compile_to_equal_offsets_of_another_tensor():
    """The rows check reads no pointer in a trace: a plan applies under torch.compile(fullgraph=True) to a nested
    tensor of equal offsets held in another tensor (int32 here, the plan's are int64)."""
    x = _jagged(torch.randn(10, 4), [0, 3, 10])
    _, info = to_thd(x)
    y = torch.nested.nested_tensor_from_jagged(x.values() * 2, torch.tensor([0, 3, 10], dtype=torch.int32))
    got = torch.compile(lambda t: to_thd(t, info)[0], fullgraph=True, backend="eager")(y)
    assert torch.equal(got, to_thd(x, info)[0] * 2)


def test_next_token_labels_refuse_a_narrowed_nested_view():
    view = torch.nested.narrow(torch.arange(12).reshape(2, 6), 1, torch.tensor([1, 0]), torch.tensor([3, 2]),
                               layout=torch.jagged)
    with pytest.raises(ValueError, match="narrowed view"):
        next_token_labels(view, None)
    assert next_token_labels(view.contiguous(), None).values().tolist() == [2, 3, -100, 7, -100]
