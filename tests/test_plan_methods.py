"""Plans own their dispatch: ``pack_positions`` / ``unpack_positions`` and the vision hook call the plan's methods
(``pack_tokens``, ``unpack_tokens``, ``token_dims``; ``inputs_to_embed``, ``decoder_input``,
``decoder_positions``) and never ask which layout a plan is.

Strategy: each method equals the layout's own function on the same plan; a plan type packfwd does not know works
through ``pack_positions`` when it has the methods, and one without them gets a TypeError naming the missing one.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import packfwd as pf
from packfwd.forward.vision import VisionPacking, decoder_input, packed_positions
from packfwd.layout.source import PlanOfSource, TokenSource

MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 1, 1, 1, 1], [1, 0, 1, 0, 1]]).bool()
X = torch.arange(15 * 2).reshape(3, 5, 2)


def test_methods_equal_the_layout_functions():
    info = pf.plan_unpad(MASK)
    assert info.token_dims == 1
    assert torch.equal(info.pack_tokens(X), pf.unpad(X, info)[0])
    assert torch.equal(info.unpack_tokens(info.pack_tokens(X), -1), pf.pad(pf.unpad(X, info)[0], info, -1))
    with pytest.raises(ValueError, match="got 2 tensors but a unpad plan takes one"):
        info.unpack_tokens([info.pack_tokens(X)] * 2)

    bshd = pf.plan_bshd(MASK)
    assert bshd.token_dims == 2
    assert torch.equal(bshd.pack_tokens(X), pf.to_bshd(X, bshd)[0])
    assert torch.equal(bshd.unpack_tokens([bshd.pack_tokens(X)]), pf.from_bshd(pf.to_bshd(X, bshd)[0], bshd))

    plans = [pf.plan_thd(MASK, cp_size=2, cp_rank=r) for r in (0, 1)]
    assert plans[0].token_dims == 1
    ranks = [p.pack_tokens(X) for p in plans]
    assert all(torch.equal(y, pf.to_thd(X, p)[0]) for y, p in zip(ranks, plans))
    assert torch.equal(plans[0].unpack_tokens(ranks, fill_value=7), pf.from_thd(ranks, plans[0], fill_value=7))


@dataclasses.dataclass(frozen=True)
class ReversedUnpad:
    """A layout packfwd does not know: ``unpad``'s tokens in reverse order."""

    inner: pf.UnpadInfo
    token_dims = 1

    @property
    def source(self) -> TokenSource:
        return self.inner.source

    def pack_tokens(self, x):
        return self.inner.pack_tokens(x).flip(0)

    def unpack_tokens(self, y, fill_value=0):
        return self.inner.unpack_tokens(y.flip(0) if isinstance(y, torch.Tensor) else y[0].flip(0), fill_value)


def test_a_new_plan_type_with_the_methods_packs_positions():
    """Before the plans owned their dispatch, ``pack_positions`` took only its three known plan types."""
    pos = torch.stack([MASK.cumsum(1) - 1, 10 * (MASK.cumsum(1) - 1), MASK.long()]) * MASK  # [3, b, s]
    plan = ReversedUnpad(pf.plan_unpad(MASK))
    got = pf.pack_positions(pos, plan)  # [3, t]
    assert torch.equal(got, pf.pack_positions(pos, plan.inner).flip(-1))
    assert torch.equal(pf.unpack_positions(got, plan), pos)
    assert torch.equal(pf.unpack_positions(got.T, plan, coord_dim=-1), pos.movedim(0, -1))  # [b, s, k]


@dataclasses.dataclass(frozen=True)
class BarePlan(PlanOfSource):
    """A plan with a source but none of the methods."""

    source: TokenSource


def test_a_plan_without_the_methods_gets_a_type_error_naming_them():
    bare = BarePlan(pf.plan_unpad(MASK).source)
    with pytest.raises(TypeError, match="got BarePlan, which has no pack_tokens"):
        pf.pack_positions(MASK.long(), bare)
    with pytest.raises(TypeError, match="got BarePlan, which has no pack_tokens"):
        pf.unpack_positions(torch.zeros(9), bare)
    with pytest.raises(TypeError, match=r"plan must be a ThdInfo or BshdInfo \(a layout plan with decoder_input\), "
                                        "got BarePlan"):
        decoder_input(torch.zeros(3, 5, 4), bare)
    # unpad is not a model layout: it has no decoder_input, and the hook says so
    with pytest.raises(TypeError, match="got UnpadInfo"):
        VisionPacking(pf.plan_unpad(MASK)).embeddings(torch.zeros(3, 5, 4))
    with pytest.raises(TypeError, match="decoder_positions"):
        packed_positions(torch.zeros(3, 3, 5), pf.plan_unpad(MASK))


def test_vision_methods_of_thd_and_bshd():
    thd, bshd = pf.plan_thd(MASK, cp_size=2, cp_rank=1), pf.plan_bshd(MASK)
    ids = torch.arange(15).reshape(3, 5)
    h = torch.randn(3, 5, 4)
    assert torch.equal(thd.decoder_input(h), pf.to_thd(h, thd)[0][:, None])  # [t, 1, h]
    assert thd.inputs_to_embed(ids, "packed", MASK, None) == (ids, MASK, None)  # the caller's batch
    packed_ids = bshd.pack_tokens(ids)
    given_ids, given_mask, given_pos = bshd.inputs_to_embed(ids, packed_ids, MASK.long(), ids)
    assert given_ids is packed_ids and given_mask.dtype == torch.long
    assert torch.equal(given_mask.bool(), bshd.attention_mask) and torch.equal(given_pos, pf.to_bshd(ids, bshd)[0])
    hc = bshd.pack_tokens(h)
    assert torch.equal(bshd.decoder_input(hc), hc.transpose(0, 1))  # [s_c, b, h]
    with pytest.raises(ValueError, match="compacted batch the model was given"):
        bshd.decoder_input(h)
    with pytest.raises(ValueError, match="padded batch the model was given"):
        thd.decoder_input(hc)
