"""packfwd with verl's alignment (2*tp*cp, or tp without CP) against verl's own packing functions, token for
token.  verl is a test/benchmark-only dependency installed with --no-deps; the test skips when it is missing."""

import pytest
import torch
from hypothesis import given

from packfwd import from_thd, to_thd

from .strategies import batches, parallel
from .verl_ref import load_verl_util, patched_mpu

verl = load_verl_util()
pytestmark = pytest.mark.skipif(verl is None, reason="verl is not installed (make test installs it with --no-deps)")


@given(batches(min_b=1, dtypes=[torch.int64, torch.float32]), parallel)
def test_preprocess_packed_seqs_identical(batch, par):
    x, mask = batch
    mask = mask.bool()
    tp, cp, rank = par
    with patched_mpu(verl, tp, cp, rank):
        ref, psp = verl.preprocess_packed_seqs(x, mask)
    ours, info = to_thd(x, mask, tp_size=tp, cp_size=cp, cp_rank=rank, seq_align=2 * tp * cp if cp > 1 else tp)
    assert torch.equal(ref[0], ours)
    assert torch.equal(psp.cu_seqlens_q_padded, info.cu_seqlens_padded)
    assert psp.max_seqlen_q == info.max_seqlen


@given(batches(min_b=1, dtypes=[torch.float32]), parallel)
def test_postprocess_packed_seqs_identical_without_cp(batch, par):
    x, mask = batch
    mask = mask.bool()
    tp = par[0]
    y, info = to_thd(x, mask, tp_size=tp, seq_align=tp)
    y = y * 3
    with patched_mpu(verl, tp, 1, 0):
        ref = verl.postprocess_packed_seqs(y[None], info.packed_seq_params(), mask, *mask.shape)
    assert torch.equal(ref, from_thd(y, info))
