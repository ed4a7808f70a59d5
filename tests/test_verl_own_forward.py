"""verl 0.9.1's own Megatron forwards, unchanged, on a plain packfwd model, against ``packfwd.make_forward``.

Strategy: verl's ``model_forward_gen`` (THD and BSHD) and ``gptmodel_forward_model_engine`` are loaded from the
installed verl (``tests/verl_forward_ref.py``) and called on a model from ``packfwd.models.build_model`` with no
view in between, as a verl user who keeps verl's forward and swaps in packfwd's model does.  Their logits must
equal ``make_forward("thd", seq_align=<verl's alignment>)`` / ``make_forward("bshd")`` on the same batch (verl's
layout: left-padded prompts, right-padded responses; and left- or right-padded rows alone).

verl's THD forward passes its padded ``[b, s]`` ``position_ids`` beside the packed ``[1, t]`` ids; the model takes
them as verl's default positions and does not read them (``packfwd/models/positions.py``), and refuses any other
``[b, s]`` tensor.  verl's alignment is ``tp`` without CP: here verl's packing is made to see ``tp=4`` (its
``mpu`` answers 4, the model stays one process), so sequences are padded and the padded lengths differ from the
real ones.  Equality is exact: both sides run the same kernels on the same packed tensors.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys

import pytest
import torch

from packfwd import make_forward
from packfwd.models import ModelArgs, build_model

from .verl_forward_ref import PACKAGE, load_verl_forward

vf = load_verl_forward()
pytestmark = pytest.mark.skipif(vf is None, reason="verl is not installed (make test installs it with --no-deps)")

ARGS = ModelArgs(vocab_size=96, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
                 num_query_groups=2)


@pytest.fixture(autouse=True)
def one_process_world():
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()


@pytest.fixture(scope="module")
def model():
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    torch.manual_seed(0)
    return build_model(ARGS)


class _Mpu:
    """Megatron's ``parallel_state`` as verl's packing reads it, with the TP size it aligns to replaced."""

    def __init__(self, real, tp):
        self.real, self.tp = real, tp

    def __getattr__(self, name):
        return getattr(self.real, name)

    def get_tensor_model_parallel_world_size(self):
        return self.tp


@contextlib.contextmanager
def verl_alignment(tp: int):
    """verl pads every THD sequence to a multiple of ``tp`` (no CP): make its packing see ``tp``."""
    util = sys.modules[PACKAGE + ".util"]
    real = util.mpu
    util.mpu = _Mpu(real, tp)
    try:
        yield tp
    finally:
        util.mpu = real


def make_batch(kind: str, lengths=((4, 3), (2, 6), (5, 1), (1, 4)), width=(5, 6), seed=0):
    """``(ids, mask, positions)`` ``[b, s]``: ``"verl"`` rows are a prompt left-padded to ``width[0]`` and a
    response right-padded to ``width[1]``; ``"left"`` / ``"right"`` rows are padded on one side only.  The
    positions are verl's default, ``clamp(cumsum(mask) - 1, min=0)``."""
    s = sum(width)
    mask = torch.zeros(len(lengths), s, dtype=torch.bool)
    for i, (p, r) in enumerate(lengths):
        if kind == "verl":
            mask[i, width[0] - p: width[0] + r] = True
        elif kind == "left":
            mask[i, s - p - r:] = True
        else:
            mask[i, : p + r] = True
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, ARGS.vocab_size, mask.shape, generator=g).masked_fill(~mask, 0)
    return ids, mask, (mask.cumsum(1) - 1).clamp(min=0)


def nested(x, mask):
    return torch.nested.nested_tensor([x[i][mask[i]] for i in range(x.shape[0])], layout=torch.jagged)


@pytest.mark.parametrize("tp", [1, 4], ids=["align1", "align4"])
@pytest.mark.parametrize("kind", ["verl", "left", "right"])
def test_model_forward_thd_equals_make_forward(model, kind, tp):
    ids, mask, positions = make_batch(kind)
    with torch.no_grad(), verl_alignment(tp):
        ours = make_forward("thd", seq_align=tp)(model, ids, mask)
        theirs = vf.model_forward_gen(False)(model, ids, mask, positions, {}, data_format="thd")
    assert torch.equal(theirs, ours)


@pytest.mark.parametrize("kind", ["verl", "left", "right"])
def test_model_forward_bshd_equals_make_forward(model, kind):
    ids, mask, positions = make_batch(kind)
    with torch.no_grad():
        ours = make_forward("bshd")(model, ids, mask)
        theirs = vf.model_forward_gen(False)(model, ids, mask, positions, {}, data_format="bshd")
    torch.testing.assert_close(theirs, ours, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_engine_forward_equals_make_forward(model, data_format):
    ids, mask, _ = make_batch("verl")
    with torch.no_grad():
        ours = make_forward(data_format)(model, ids, mask)[mask]  # [t, v], the real tokens in row order
        theirs = vf.gptmodel_forward_model_engine(model, nested(ids, mask), {}, data_format=data_format)
    torch.testing.assert_close(theirs.values(), ours, atol=1e-6, rtol=1e-6)


def test_value_model_thd_equals_make_forward():
    torch.manual_seed(0)
    value = build_model(dataclasses.replace(ARGS, value_head=True))
    ids, mask, positions = make_batch("verl")
    with torch.no_grad(), verl_alignment(4):
        ours = make_forward("thd", seq_align=4)(value, ids, mask)
        theirs = vf.model_forward_gen(False)(value, ids, mask, positions, {}, value_model=True)
    assert torch.equal(theirs, ours)


def test_one_left_padded_sequence_as_wide_as_its_packing(model):
    """One sequence whose padded width equals its packed length: verl's ``[1, s]`` positions have the shape of
    packed positions, and its default of a left-padded row (``0, 0, 0, 1, ...``) would be wrong read as such."""
    ids, mask, positions = make_batch("left", lengths=((3, 3),), width=(4, 4))  # 6 real tokens, s = 8
    with torch.no_grad(), verl_alignment(4):  # padded to 8 = s
        ours = make_forward("thd", seq_align=4)(model, ids, mask)
        theirs = vf.model_forward_gen(False)(model, ids, mask, positions, {}, data_format="thd")
    assert positions[0, :3].tolist() == [0, 0, 0]
    assert torch.equal(theirs, ours)


def test_later_pipeline_stage_thd_equals_make_forward():
    """pp=2 in one process: verl gives the second stage the padded ``[b, s]`` ids and positions with the packed
    params; the stage takes its packed length from the hidden states it was given."""
    torch.manual_seed(0)
    stages = [build_model(ARGS, pp_rank=r, pp_size=2) for r in range(2)]
    ids, mask, positions = make_batch("verl")

    def two_stages(forward):
        hidden = forward(stages[0])
        stages[1].set_input_tensor(hidden)
        return forward(stages[1])

    with torch.no_grad(), verl_alignment(4):
        ours = two_stages(lambda m: make_forward("thd", seq_align=4)(m, ids, mask))
        theirs = two_stages(lambda m: vf.model_forward_gen(False)(m, ids, mask, positions, {}, data_format="thd"))
    assert torch.equal(theirs, ours)


def verl_call(ids, mask, tp=4):
    """What verl's THD forward gives the model: the packed ids ``[1, t]`` and verl's ``PackedSeqParams``."""
    util = sys.modules[PACKAGE + ".util"]
    with verl_alignment(tp):
        return util.preprocess_packed_seqs(ids, mask)


def packfwd_call(ids, mask):
    """What ``make_forward("thd", seq_align=4)`` gives the model: its params carry the real lengths."""
    from packfwd import plan_thd, to_thd

    info = plan_thd(mask, seq_align=4)
    return to_thd(ids, info)[0][None], info.packed_seq_params()


BAD = {
    "shifted": lambda pos: pos + 3,
    "jump": lambda pos: pos * 2,
    "too_long": lambda pos: torch.arange(pos.shape[1]).expand_as(pos),  # more tokens than a sequence holds
    "other_batch": lambda pos: pos[:3],
    "rows_swapped": lambda pos: pos[[1, 0, 2, 3]],  # lengths 8 and 7: caught where the real lengths are known
}


@pytest.mark.parametrize("case", list(BAD))
@pytest.mark.parametrize("call", [verl_call, packfwd_call], ids=["verl_params", "packfwd_params"])
def test_other_padded_positions_beside_thd_raise(model, case, call):
    ids, mask, positions = make_batch("verl")
    packed, params = call(ids, mask)
    if case == "rows_swapped" and call is verl_call:
        pytest.skip("verl's params carry padded lengths only: a swap within the padded length is not seen")
    with pytest.raises(ValueError, match="verl's default|beside a THD batch"):
        model(packed, BAD[case](positions), None, packed_seq_params=params)


def test_packed_positions_are_still_read(model):
    """Caller positions ``[1, t]`` beside THD are honoured: doubling them changes the logits (RoPE is relative: a
    shift would not); verl's default ``[b, s]`` gives the numbers of the packed default positions."""
    from packfwd import pack_positions, plan_thd

    ids, mask, positions = make_batch("verl")
    packed, params = packfwd_call(ids, mask)
    at = pack_positions(positions, plan_thd(mask, seq_align=4))[None]
    with torch.no_grad():
        plain = model(packed, at, None, packed_seq_params=params)
        doubled = model(packed, at * 2, None, packed_seq_params=params)
        default = model(packed, positions, None, packed_seq_params=params)
    assert torch.equal(plain[0][packed[0] != 0], default[0][packed[0] != 0])
    assert not torch.allclose(plain, doubled)


def test_device_checks_name_the_fix_in_torchs_limit(monkeypatch):
    """On CUDA the checks are ``torch._assert_async`` (no host sync), whose message torch caps under 255
    characters: the checks are run on meta tensors (no values, any device but the CPU) and their messages read."""
    from packfwd.models.runtime.positions import assert_per_sequence, check_default_positions

    said = []
    monkeypatch.setattr(torch, "_assert_async", lambda ok, message: said.append(message))
    ids, mask, positions = make_batch("verl")
    _, params = verl_call(ids, mask)
    meta = dataclasses.replace(params, cu_seqlens_q=params.cu_seqlens_q.to("meta"),
                               cu_seqlens_q_padded=params.cu_seqlens_q_padded.to("meta"))
    check_default_positions(positions.to("meta"), meta)
    assert_per_sequence(torch.zeros(8, dtype=torch.long, device="meta"), meta, 1, 0)
    assert len(said) == 2 and all(len(m) < 255 for m in said), said
    assert "verl's default" in said[0] and "packed_rope=True" in said[1]
