"""Scored tokens only on the GPU (:mod:`packfwd.forward.scored`): host syncs caught by
``torch.cuda.set_sync_debug_mode`` (the helpers of ``test_forward_no_sync.py``).  With host ``seqlens`` and
``scored_tokens`` the forward and backward make none, on both heads, THD and BSHD; planned from the device mask
the forward makes two (the plan's lengths, the scored count), and the numbers are the same bits; with ``seqlens``
and no count none, every row computed and masked.  At the scored tokens the log-probs equal the forward scoring
every token (bf16 rounding of a matmul over other rows), and are exactly 0 at the others.

    PYTHONPATH=. python3 -m pytest -q tests/gpu/test_scored_no_sync.py
"""

from __future__ import annotations

import pytest
import torch

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.logits import log_probs_and_entropy
from packfwd.models import ModelArgs, build_model

from .test_forward_no_sync import no_sync, syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ARGS = ModelArgs(vocab_size=4096, hidden_size=128, ffn_hidden_size=256, num_layers=2, num_attention_heads=4,
                 num_query_groups=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return build_model(ARGS, device="cuda", params_dtype=torch.bfloat16)


@pytest.fixture
def batch():
    """ids, mask [6, 256] (left prompts, right responses), labels ignoring the prompts, the host lengths and the
    scored count."""
    g = torch.Generator(device="cuda").manual_seed(1)
    n = torch.tensor([128, 100, 64, 17, 1, 90])
    col = torch.arange(256)[None, :]
    mask = ((col >= 128 - n[:, None]) & (col < 128 + n[:, None])).cuda()
    ids = torch.randint(1, ARGS.vocab_size, mask.shape, device="cuda", generator=g)
    labels = next_token_labels(ids, mask)
    labels[:, :127] = -100  # the prompts (token 127 predicts the first response token)
    kept = mask & (labels >= 0)
    return ids, mask, labels, (2 * n).tolist(), int(kept.sum().item()), kept


@pytest.mark.parametrize("head", ["logits", "fused"])
@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_scored_forward_and_backward_with_host_counts_make_no_sync(model, batch, head, data_format):
    ids, mask, labels, lengths, count, kept = batch
    forward = make_forward(data_format, logits_processor=log_probs_and_entropy, head=head)

    def step(**kw):
        model.zero_grad(set_to_none=True)
        out = forward(model, ids, mask, labels=labels, **kw)
        (out["log_probs"].float().sum() + out["entropy"].float().sum()).backward()
        return {k: v.detach() for k, v in out.items()}

    want = step()  # the count read back with the plan's lengths; also the warm-up
    _, found = syncs(step)
    assert len(found) == 2, "host syncs:\n" + "\n".join(found)  # the plan's lengths, the scored count
    got = no_sync(lambda: step(seqlens=lengths, scored_tokens=count))
    for k in want:
        assert torch.equal(got[k], want[k]), k
        assert not got[k][~kept].any() and got[k][kept].abs().sum() > 0
    every = make_forward(data_format, logits_processor=log_probs_and_entropy, head=head, scored_only=False)
    with torch.no_grad():
        full = every(model, ids, mask, labels=labels)
        masked = no_sync(lambda: forward(model, ids, mask, labels=labels, seqlens=lengths))  # every row, masked
    for k in want:
        torch.testing.assert_close(got[k][kept], full[k][kept], atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(masked[k][kept], full[k][kept], atol=2e-2, rtol=2e-2)
        assert not masked[k][~kept].any()
