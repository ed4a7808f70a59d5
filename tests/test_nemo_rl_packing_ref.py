"""The NeMo-RL packing reference (``tests/nemo_rl_packing_ref.py``) on cases worked by hand from the rules its
docstring states, each chosen to exercise one phase or tie rule, plus properties: a valid plan (a permutation,
no bin over capacity, equal counts per rank) and phase 5 equal to a plain worst-fit-decreasing loop."""

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.nemo_rl_packing_ref import adjust_bin_count, mffd_bins, nemo_rl_plan


def test_all_phases():
    # C = 100.  large 70 (5), 60 (0); medium 45 (1), 35 (6); small 20 (2), 25 (3); tiny 10 (4), 15 (7).
    # Phase 2: the 70-bin has room 30, no medium fits; the 60-bin takes 35.  Phase 3: the 60-bin holds a
    # medium, the 70-bin has room 30 < 20 + 25.  Phase 4: the 70-bin takes 25 (room 5 left), the 95-bin nothing.
    # Phase 5: 45, 20, 15, 10 all go to one bin (90).
    sizes = [60, 45, 20, 25, 10, 70, 35, 15]
    assert mffd_bins(sizes, 100) == [[5, 3], [0, 6], [1, 2, 7, 4]]
    # dp=2: 3 bins -> 4; the new bin takes the last sequence (4) of the bin with the most sequences.
    assert nemo_rl_plan(sizes, max_tokens=100, dp_size=2, pad_multiple=1) == [[[5, 3], [1, 2, 7]], [[0, 6], [4]]]


def test_phase3_two_small_items():
    # The 55-bin (room 45, no medium) takes the smallest small (20) and then the largest small that still fits
    # (22 <= 25; 30 does not).  Plain first-fit decreasing would give [[0, 3, 4], [2, 1]].
    assert mffd_bins([55, 20, 22, 30, 5], 100) == [[0, 1, 2], [3, 4]]


def test_phase5_is_worst_fit_not_first_fit():
    # No large item, so phase 5 packs everything: 5 and 3 fill bin A to 8; the second 3 opens B; each 2 goes to
    # the least-filled bin (B), not the first that fits (A).  Bins come out by increasing fill.
    assert mffd_bins([5, 3, 3, 2, 2], 10) == [[2, 3, 4], [0, 1]]


def test_phase5_tie_goes_to_the_bin_filled_earlier():
    # After 4,4 | 4,4 both bins hold 8; the 1 goes to A, last filled before B.
    assert mffd_bins([4, 4, 4, 4, 1], 10) == [[2, 3], [0, 1, 4]]


def test_count_raised_to_dp_by_moving_single_sequences():
    # MFFD gives [[3], [0, 1, 2]]; new bins take sequences from the end of the fullest bin, repeatedly.
    assert nemo_rl_plan([3, 3, 3, 3], max_tokens=10, dp_size=2, pad_multiple=1) == [[[3]], [[0, 1, 2]]]
    assert nemo_rl_plan([3, 3, 3, 3], max_tokens=10, dp_size=3, pad_multiple=1) == [[[3]], [[0, 1]], [[2]]]
    assert nemo_rl_plan([3, 3, 3, 3], max_tokens=10, dp_size=4, pad_multiple=1) == [[[3]], [[0]], [[2]], [[1]]]
    assert adjust_bin_count([[0], [1, 2]], 2, 1) == [[0], [1, 2]]  # already enough: unchanged


def test_largest_first_reorders_within_a_rank_only():
    packer = nemo_rl_plan([3, 3, 3, 3], max_tokens=10, dp_size=1, pad_multiple=1)
    largest = nemo_rl_plan([3, 3, 3, 3], max_tokens=10, dp_size=1, pad_multiple=1, microbatch_order="largest_first")
    assert packer == [[[3], [0, 1, 2]]] and largest == [[[0, 1, 2], [3]]]


def test_budget_counts_padded_lengths():
    # Padded to 4: 8, 8, 4.  Raw lengths (13 tokens) would all fit one micro-batch of 16; padded ones do not.
    assert nemo_rl_plan([5, 5, 3], max_tokens=16, dp_size=1, pad_multiple=4) == [[[2], [0, 1]]]


@pytest.mark.parametrize("seqlens, kw, match", [
    ([1, 2, 3], dict(max_tokens=10, dp_size=4, pad_multiple=1), "3 sequences"),
    ([17], dict(max_tokens=16, dp_size=1, pad_multiple=8), "padded length 24"),
    ([0, 1], dict(max_tokens=16, dp_size=1, pad_multiple=1), "sequence 0"),
])
def test_errors(seqlens, kw, match):
    with pytest.raises(ValueError, match=match):
        nemo_rl_plan(seqlens, **kw)


def test_too_few_sequences_for_a_multiple_of_dp():
    # Nine sequences over half the capacity: nine bins, raised to 16 for dp=8, but only nine sequences.
    with pytest.raises(ValueError, match="cannot make 16 non-empty micro-batches from 9 sequences"):
        nemo_rl_plan([200] * 9, max_tokens=256, dp_size=8, pad_multiple=1)


def plain_worst_fit_decreasing(sizes, capacity):
    """Each item, by decreasing size (ties by index), into the least-filled bin (ties: filled earliest) when it
    fits, else a new bin; bins listed by fill, then by when they were last filled."""
    bins, fill, touched = [], [], []
    for t, i in enumerate(sorted(range(len(sizes)), key=lambda i: (-sizes[i], i))):
        b = min(range(len(bins)), key=lambda b: (fill[b], touched[b]), default=None)
        if b is not None and fill[b] + sizes[i] <= capacity:
            bins[b].append(i)
            fill[b] += sizes[i]
            touched[b] = t
        else:
            bins.append([i])
            fill.append(sizes[i])
            touched.append(t)
    return [bins[b] for b in sorted(range(len(bins)), key=lambda b: (fill[b], touched[b]))]


@given(st.lists(st.integers(1, 50), min_size=1, max_size=60))
def test_without_large_items_mffd_is_worst_fit_decreasing(sizes):
    assert mffd_bins(sizes, 100) == plain_worst_fit_decreasing(sizes, 100)


@given(st.lists(st.integers(1, 200), min_size=8, max_size=80), st.integers(1, 8), st.sampled_from([1, 2, 8]))
def test_plan_is_valid(seqlens, dp, pad):
    padded = [-(-n // pad) * pad for n in seqlens]
    target = -(-max(len(mffd_bins(padded, 256)), dp) // dp) * dp
    if len(seqlens) < target:  # NeMo-RL raises rather than leave a micro-batch empty
        with pytest.raises(ValueError, match="non-empty micro-batches"):
            nemo_rl_plan(seqlens, max_tokens=256, dp_size=dp, pad_multiple=pad)
        return
    plan = nemo_rl_plan(seqlens, max_tokens=256, dp_size=dp, pad_multiple=pad)
    assert sorted(i for mbs in plan for mb in mbs for i in mb) == list(range(len(seqlens)))
    assert len({len(mbs) for mbs in plan}) == 1 and len(plan) == dp
    assert all(mb and sum(padded[i] for i in mb) <= 256 for mbs in plan for mb in mbs)
