"""packfwd.models.mixers.rope: THD RoPE without host syncs.

Strategy: the positions RoPE uses (``packfwd.layout.rules.local_positions``) are checked against
``packfwd.position_ids`` of the same THD plan and a plain loop; the rotation against Megatron-Core's
``apply_rotary_pos_emb`` on the same THD tensor (bitwise: the arithmetic is the same op for op); and a whole
model's THD forward against the same weights in a model built with Megatron-Core's own THD RoPE
(``packed_rope=False``).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

from packfwd import plan_thd, position_ids
from packfwd.forward import make_forward
from packfwd.layout.rules import local_positions
from packfwd.models import ModelArgs, build_model
from packfwd.models.mixers.attention import CoreAttention
from packfwd.models.runtime import transformer_config
from packfwd.models.convert.hf import load_weights
from packfwd.models.mixers.rope import PackedRope, PackedRotaryEmbedding
from packfwd.models.runtime import StagePlacement

from .test_hf_interop import ragged_batch

ARGS = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, head_dim=16)


def loop_positions(padded_lengths, cp, rank):
    out = []
    for p in padded_lengths:
        c = p // (2 * cp)
        chunks = (rank, 2 * cp - 1 - rank) if cp > 1 else (0,)
        width = c if cp > 1 else p
        for k in chunks:
            out += range(k * width, (k + 1) * width)
    return out


@pytest.mark.parametrize("cp", [1, 2, 3])
def test_positions_match_the_plan_and_a_loop(cp):
    g = torch.Generator().manual_seed(cp)
    lengths = torch.randint(0, 20, (7,), generator=g)
    lengths[2] = 0  # an empty row: a zero-length sequence
    mask = torch.arange(20)[None] < lengths[:, None]
    for rank in range(cp):
        info = plan_thd(mask, cp_size=cp, cp_rank=rank, tp_size=2)
        got = local_positions(info.cu_seqlens_padded, info.local_tokens, cp, rank)
        assert got.tolist() == position_ids(info).tolist()
        assert got.tolist() == loop_positions(info.cu_seqlens_padded.diff().tolist(), cp, rank)


def rotary(interleaved=False):
    return PackedRotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved,
                                 rotary_base=10000, use_cpu_initialization=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("cp", [1, 2])
def test_rotation_is_megatrons_bit_for_bit(dtype, interleaved, cp):
    cu = torch.tensor([0, 8, 12, 12, 24], dtype=torch.int32)  # padded lengths 8, 4, 0, 12 (multiples of 2cp)
    max_seqlen = 12
    config = dataclasses.replace(transformer_config(ARGS), rotary_interleaved=interleaved)
    rope = rotary(interleaved)
    table = rope.get_emb(max_seqlen)
    for rank in range(cp):
        t = int(cu[-1]) // cp
        q, k = torch.randn(t, 4, 16).to(dtype), torch.randn(t, 2, 16).to(dtype)
        group = StagePlacement(rank_=rank, size_=cp)
        # Megatron's own THD path without the empty sequence (0.19's interleaved rotation cannot take an empty
        # slice); an empty sequence holds no token, so the rotation is the same
        nonempty = torch.unique_consecutive(cu)
        want_q = apply_rotary_pos_emb(q, table, config, cu_seqlens=nonempty, cp_group=group)
        want_k = apply_rotary_pos_emb(k, table, config, cu_seqlens=nonempty, cp_group=group)
        got_q, got_k = PackedRope(rope)(q, k, cu, cp, rank)
        assert got_q.dtype == dtype and torch.equal(got_q, want_q) and torch.equal(got_k, want_k)


def test_model_thd_forward_equals_megatrons_own_thd_rope():
    torch.manual_seed(0)
    model = build_model(ARGS)
    assert model.rotary_pos_emb(16, packed_seq=True) is None
    cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
    assert len(cores) == 2 and all(c.rope is not None for c in cores)
    megatron = load_weights(build_model(ARGS, init=False, packed_rope=False),
                            {n: p.detach() for n, p in model.named_parameters()})
    assert megatron.rotary_pos_emb(16, packed_seq=True) is not None
    ids, mask = ragged_batch("mixed")
    with torch.no_grad():
        ours = make_forward("thd")(model, ids, mask)
        theirs = make_forward("thd")(megatron, ids, mask)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=0)
    assert ours[mask].abs().sum() > 0 and not ours[~mask].any()


def test_state_dict_is_unchanged():
    model = build_model(ARGS, init=False)
    assert not any("rope" in name or "rotary" in name for name in model.state_dict())


def test_one_table_per_forward_never_kept_after_it(monkeypatch):
    """The layers of one forward share their model's PackedRope: inside ``one_forward`` the angle tables are made
    once per batch, not once per layer, and anew for another source tensor (or another dtype); outside it, at
    every call; at its end they are dropped (no table outlives its forward: a plan changed in place later, by
    any means, cannot be read stale).  Each time equal to a fresh PackedRope's."""
    from packfwd.models.mixers import rope as rope_module

    calls, counting = [], [True]
    real = rope_module.rotary_freqs

    def counted(*a, **k):
        if counting[0]:
            calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(rope_module, "rotary_freqs", counted)
    g = torch.Generator().manual_seed(0)
    rope = PackedRope(rotary())
    q, k = torch.randn(10, 4, 16, generator=g), torch.randn(10, 2, 16, generator=g)

    def same(got, cu, positions=None, dtype=torch.float32):  # against a fresh PackedRope (its tables not counted)
        counting[0] = False
        want = PackedRope(rotary())(q.to(dtype), k.to(dtype), cu, positions=positions)
        counting[0] = True
        return all(torch.equal(a, b) for a, b in zip(got, want))

    cu = torch.tensor([0, 4, 10])
    with rope.one_forward():
        calls.clear()
        for _ in range(3):  # three layers
            assert same(rope(q, k, cu), cu)
        assert len(calls) == 1
        other = torch.tensor([0, 7, 10])
        assert same(rope(q, k, other), other) and len(calls) == 2
        assert same(rope(q.double(), k.double(), other), other, dtype=torch.float64) and len(calls) == 3
        positions = torch.arange(10)
        assert same(rope(q, k, other, positions=positions), None, positions)
        assert rope._last is not None
    assert rope._last is None
    calls.clear()
    cu.data.copy_(torch.tensor([0, 7, 10]))  # changed without a version bump, between forwards
    for _ in range(2):
        assert same(rope(q, k, cu), cu)
    assert len(calls) == 2 and rope._last is None  # outside a forward: made at every call, never kept


def test_a_model_forward_makes_its_tables_once(monkeypatch):
    """A 2-layer model's THD forward computes its RoPE angles once (not per layer), and equals the forward of a
    model that keeps no tables."""
    from packfwd.models.mixers import rope as rope_module

    calls = []
    real = rope_module.rotary_freqs
    monkeypatch.setattr(rope_module, "rotary_freqs", lambda *a, **k: calls.append(1) or real(*a, **k))
    torch.manual_seed(0)
    model = build_model(ARGS, device="cpu")
    ids, mask = ragged_batch("mixed")
    forward = make_forward("thd")
    with torch.no_grad():
        got = forward(model, ids, mask)
        assert len(calls) == 1
        model._rope_scope = None  # no scope: every layer makes its own
        want = forward(model, ids, mask)
        assert len(calls) == 1 + ARGS.num_layers
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_the_tables_are_not_kept_under_a_torch_func_transform_or_in_a_copy():
    """Under vmap the tables are computed in the transform and not kept (a later eager call must not read them); a
    copied model keeps none."""
    import copy

    rope = PackedRope(rotary())
    cu = torch.tensor([0, 4, 10])
    q, k = torch.randn(2, 10, 4, 16), torch.randn(2, 10, 2, 16)
    with rope.one_forward():
        got = torch.func.vmap(lambda a, b: rope(a, b, cu))(q, k)
        assert rope._last is None
        for i in range(2):
            assert all(torch.equal(x[i], y) for x, y in zip(got, PackedRope(rotary())(q[i], k[i], cu)))
        rope(q[0], k[0], cu)
        assert rope._last is not None
        assert copy.copy(rope)._last is None and rope.__getstate__()["_last"] is None
