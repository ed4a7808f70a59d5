"""Fixed-bucket mode under CUDA graphs: a packed forward (THD packing, linear maps, causal varlen attention,
unpacking) captured once with one batch's bucket plan, then replayed for new batches of other lengths, gives
exactly what running it eagerly with each batch's plan gives; and the real tokens match the forward planned
without a bucket.  Both gather paths (the Triton op for large tensors, plain torch for small ones) are captured.

    PYTHONPATH=. python -m pytest -q tests/gpu
"""

import pytest
import torch

from packfwd.ops import gather as _rows
from packfwd import plan_thd
from packfwd.layout.bucket import Bucket, capture, plan_thd_bucket

from ._forward import forward, make_weights

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B, S = 8, 256
BUCKET = Bucket(tokens=B * S, max_seqlen=S)


def batch(seed, hidden):
    g = torch.Generator(device="cuda").manual_seed(seed)
    lengths = torch.randint(0, S + 1, (B,), generator=g, device="cuda")
    lengths[seed % B] = S  # one full row
    mask = torch.arange(S, device="cuda")[None] < lengths[:, None]
    x = torch.randn(B, S, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    return x, mask


@pytest.mark.parametrize("path, hidden", [("kernel", 1024), ("torch", 64)])
@pytest.mark.parametrize("attention", [True, False])
def test_replays_equal_eager_for_new_batches(path, hidden, attention, monkeypatch):
    if path == "kernel":
        pytest.importorskip("triton")
        monkeypatch.setattr(_rows, "use_op", lambda src: True)
    else:
        monkeypatch.setattr(_rows, "use_op", lambda src: False)
    weights = make_weights(hidden, "cuda")
    fn = lambda x, info: forward(x, info, weights, attention)  # noqa: E731
    x0, m0 = batch(0, hidden)
    replay = capture(fn, x0, plan_thd_bucket(m0, BUCKET))
    for seed in (1, 2, 3):
        x, mask = batch(seed, hidden)
        info = plan_thd_bucket(mask, BUCKET, seqlens=mask.sum(1).tolist())
        got = replay(x, info).clone()
        eager = fn(x, info)
        assert torch.equal(got, eager), f"replay differs from eager for batch {seed}"
        unbucketed = fn(x, plan_thd(mask))
        m = mask[..., None]
        assert torch.equal(got * ~m, torch.zeros_like(got))  # padding stays zero
        err = ((got.float() - unbucketed.float()) * m).abs().max() / unbucketed.float().abs().max()
        assert err < 1e-2, f"bucketed forward differs from the unbucketed one by {err:.2e}"
