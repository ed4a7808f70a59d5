"""``packfwd.verl`` against verl 0.9.1's own forwards, on the same packfwd model.

Strategy: verl's ``model_forward_gen`` and ``gptmodel_forward_model_engine`` are loaded from the installed verl
(``tests/verl_forward_ref.py``) and run on the same packfwd-built Megatron-Core model as ``packfwd.verl``'s, on
the same batch (left-padded prompts followed by right-padded responses, as verl lays them out), in one process
and under real TP=2 (with sequence parallelism) and CP=2 worlds (gloo, Megatron's real ``parallel_state``).
Outputs must agree, and so must the parameter gradients of one fixed weighted sum of the outputs.  The model is
Megatron-Core's GPTModel, so verl's functions run unchanged on the CPU; two thin views (:class:`AsMegatron`) stand
in where the packfwd model differs from a TE-backed GPTModel (see its docstring).

Where packfwd deliberately differs from verl (docs/verl.md, "Where packfwd.verl differs from verl"), the test checks
packfwd's result instead: in the nested forward the label at each sequence's last token is 0 (verl's rolls across
the sequence boundary), so the log-probs there are compared with ``log_softmax(logits)[0]`` and left out of the
gradient's loss; a Qwen2.5-VL video (whose timing and positions verl drops) is compared with transformers.

Tolerances (float32): outputs ``atol=1e-5, rtol=1e-5``, gradients ``atol=1e-5, rtol=1e-4``.  The largest
differences seen are 0 everywhere, in one process and under TP=2 and CP=2: packfwd lays the batch out token for
token as verl does, so the model runs the same kernels on the same tensors (the tolerances leave room for a
different gather order on other hardware).
"""

from __future__ import annotations

import functools

import pytest
import torch

import packfwd.verl as pv
from packfwd import to_thd

from .verl_dropin_support import (EVERY, OUT_TOL, Recorder, batch, compare, engine_args,
                                  engine_processor, last_tokens, log_prob_processor, models, nested, rank_cases,
                                  same_call, vf, views)
from .verl_forward_ref import MtpConfig

pytestmark = pytest.mark.skipif(vf is None, reason="verl is not installed (make test installs it with --no-deps)")


@pytest.fixture(autouse=True)
def one_process_world():
    """Megatron's parallel state of one process (verl's functions and ours read it)."""
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()


# --------------------------------------------------------------------------------------- model_forward_gen


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
@pytest.mark.parametrize("with_processor", [False, True], ids=["logits", "processor"])
def test_model_forward_matches_verl(data_format, with_processor):
    b, model = batch(), models().policy
    ref_model, our_model = views(model, data_format)
    kw = dict(data_format=data_format)
    if with_processor:
        kw.update(logits_processor=log_prob_processor, logits_processor_args=dict(
            label=b.labels, label_mask=b.label_mask, temperature=b.temperature))
    ref = functools.partial(vf.model_forward_gen(False), ref_model, b.ids, b.mask, b.positions, {}, **kw)
    ours = functools.partial(EVERY.model_forward_gen(False), our_model, b.ids, b.mask, b.positions, {}, **kw)
    compare(ref, ours, [model])


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_value_model_matches_verl(data_format):
    b, model = batch(), models().value
    ref_model, our_model = views(model, data_format)
    kw = dict(value_model=True, data_format=data_format)
    ref = functools.partial(vf.model_forward_gen(False), ref_model, b.ids, b.mask, b.positions, {}, **kw)
    ours = functools.partial(pv.model_forward_gen(False), our_model, b.ids, b.mask, b.positions, {}, **kw)
    _, _, out = compare(ref, ours, [model])
    assert out[0].shape == b.ids.shape


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_value_model_true_on_a_language_model_is_refused(data_format):
    """Hazard (verl's too): value_model=True on a model whose output is a vocabulary's logits returned their first
    column as "values" (the padded forward), or the logits unchanged (the engine's)."""
    b, model = batch(), models().policy
    _, our_model = views(model, data_format)
    with pytest.raises(ValueError, match=r"value_model=True but the model's output has \d+ columns"):
        pv.model_forward_gen(False)(our_model, b.ids, b.mask, b.positions, {}, value_model=True,
                                    data_format=data_format)
    with pytest.raises(ValueError, match=r"value_model=True but the model's output has \d+ columns"):
        pv.gptmodel_forward_model_engine(our_model, nested(b.ids, b.mask), {}, value_model=True,
                                         data_format=data_format)


def test_a_critic_without_packfwds_value_head_flag_runs_an_empty_batch():
    """verl builds its critic with a width-1 output layer of its own (no value_head flag): an empty batch (the
    model not run) gives zeros [b, s], as before the width check."""
    b, critic = batch(), models().value
    critic.output_layer.value_head = False
    try:
        empty = torch.zeros_like(b.mask)
        values = pv.model_forward_gen(False)(critic, b.ids, empty, b.positions, {}, value_model=True,
                                             data_format="thd")
        assert values.shape == b.ids.shape and not values.any()
        full = pv.model_forward_gen(False)(critic, b.ids, b.mask, b.positions, {}, value_model=True,
                                           data_format="thd")
        assert full.shape == b.ids.shape
    finally:
        critic.output_layer.value_head = True


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_pipeline_stages_match_verl(data_format):
    """pp=2, both stages in this process: the first returns its hidden states as is, the second takes them."""
    b, stages = batch(), models().stages
    kw = dict(data_format=data_format, logits_processor=log_prob_processor,
              logits_processor_args=dict(label=b.labels, label_mask=b.label_mask, temperature=b.temperature))

    def two_stages(forward, view):
        hidden = forward(view(stages[0]), b.ids, b.mask, b.positions, {}, **kw)
        assert not isinstance(hidden, dict)
        stages[1].set_input_tensor(hidden)
        return {"hidden": hidden, **forward(view(stages[1]), b.ids, b.mask, b.positions, {}, **kw)}

    ref = functools.partial(two_stages, vf.model_forward_gen(False), lambda m: views(m, data_format)[0])
    ours = functools.partial(two_stages, EVERY.model_forward_gen(False), lambda m: views(m, data_format)[1])
    if data_format == "thd":
        compare(ref, ours, stages)
        return
    # BSHD: packfwd's first stage hands on [w, b, h] as verl's does with Megatron-Core's GPTModel (the rows' real
    # tokens first, w the longest); verl's call of packfwd's model (a padding mask) packs them, [t, 1, h]
    with torch.no_grad():
        want, got = ref(), ours()
    lengths = b.mask.sum(1)
    w = int(lengths.max())
    assert got["hidden"].shape == (w, b.ids.shape[0], want["hidden"].shape[-1])
    real = torch.arange(w) < lengths[:, None]  # [b, w]
    torch.testing.assert_close(got["hidden"].transpose(0, 1)[real], want["hidden"][:, 0], atol=1e-5, rtol=1e-5)
    for k in want.keys() - {"hidden"}:
        torch.testing.assert_close(got[k], want[k], atol=1e-5, rtol=1e-5)


def test_mtp_config():
    b, model = batch(), models().policy
    forward = pv.model_forward_gen(False)
    for config in (None, MtpConfig(), MtpConfig(enable=True)):  # MTP weights loaded but not trained: fine
        forward(model, b.ids, b.mask, b.positions, {}, mtp_config=config)
    # MTP training on a model without MTP layers: an error that names the fix (tests/test_verl_mtp.py: with them)
    with pytest.raises(ValueError, match="MTP layers"):
        forward(model, b.ids, b.mask, b.positions, {}, mtp_config=MtpConfig(enable=True, enable_train=True))
    with pytest.raises(ValueError, match="MTP layers"):
        pv.gptmodel_forward_model_engine(model, nested(b.ids, b.mask), {}, mtp_enable_train=True)


# ------------------------------------------------------------------------------ gptmodel_forward_model_engine


ENGINE_CASES = {
    "thd": dict(data_format="thd"),
    "thd_bucket": dict(data_format="thd", pad_to_length_bucket=16),
    "bshd": dict(data_format="bshd"),
    "bshd_forced": dict(data_format="bshd", forced_max_seqlen=13),
}


@pytest.mark.parametrize("case", list(ENGINE_CASES))
def test_engine_logits_match_verl(case):
    kw = ENGINE_CASES[case]
    b, model = batch(), models().policy
    ref_model, our_model = views(model, kw["data_format"])
    ids = nested(b.ids, b.mask)
    ref = functools.partial(vf.gptmodel_forward_model_engine, ref_model, ids, {}, **kw)
    ours = functools.partial(pv.gptmodel_forward_model_engine, our_model, ids, {}, **kw)
    compare(ref, ours, [model])
    assert torch.equal(ours().offsets(), ids.offsets())


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_engine_processor_matches_verl_but_at_last_tokens(data_format):
    """Equal log-probs except at each sequence's last token, where packfwd's label is 0 (verl's is the next
    sequence's first token): there packfwd's log-prob is that of token 0."""
    b, model = batch(), models().policy
    ref_model, our_model = views(model, data_format)
    ids, last = nested(b.ids, b.mask), last_tokens(b)
    kw = dict(logits_processor=engine_processor, data_format=data_format)
    ref = lambda: vf.gptmodel_forward_model_engine(ref_model, ids, {}, logits_processor_args=engine_args(b), **kw)
    args = engine_args(b)
    ours = lambda: EVERY.gptmodel_forward_model_engine(our_model, ids, {}, logits_processor_args=args, **kw)
    _, _, out = compare(ref, ours, [model], keep=(~last).float(), skip=last)
    assert set(args) == {"label", "temperature", "loss_mask", "response_attention_mask"}  # caller's dict intact
    with torch.no_grad():
        logits = pv.gptmodel_forward_model_engine(our_model, ids, {}, data_format=data_format).values()
        temperature = b.temperature[b.mask][:, None]
        expected = torch.log_softmax(logits / temperature, -1)[:, 0]
    torch.testing.assert_close(out[0][last], expected[last], **OUT_TOL)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_engine_value_model_matches_verl(data_format):
    b, model = batch(), models().value
    ref_model, our_model = views(model, data_format)
    ids = nested(b.ids, b.mask)
    ref = functools.partial(vf.gptmodel_forward_model_engine, ref_model, ids, {}, value_model=True,
                            data_format=data_format)
    ours = functools.partial(pv.gptmodel_forward_model_engine, our_model, ids, {}, value_model=True,
                             data_format=data_format)
    _, _, out = compare(ref, ours, [model])
    assert out[0].shape == (int(b.mask.sum()),)


def test_engine_pipeline_stages_match_verl():
    b, stages = batch(), models().stages
    ids = nested(b.ids, b.mask)

    def two_stages(forward, view):
        hidden = forward(view(stages[0]), ids, {})
        stages[1].set_input_tensor(hidden)
        return {"hidden": hidden, "logits": forward(view(stages[1]), ids, {})}

    ref = functools.partial(two_stages, vf.gptmodel_forward_model_engine, lambda m: views(m, "thd")[0])
    ours = functools.partial(two_stages, pv.gptmodel_forward_model_engine, lambda m: views(m, "thd")[1])
    compare(ref, ours, stages)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_vision_inputs_pass_through(data_format):
    """Vision models get what verl gives them: images, the padded ids (and mask), no positions."""
    b, images = batch(), {"pixel_values": torch.randn(6, 8), "image_grid_thw": torch.tensor([[1, 2, 3]]),
                          "other": torch.ones(1)}
    ref, ours = Recorder(), Recorder()
    vf.model_forward_gen(True)(ref, b.ids, b.mask, None, images, data_format=data_format)
    pv.model_forward_gen(True)(ours, b.ids, b.mask, None, images, data_format=data_format)
    ids = nested(b.ids, b.mask)
    kw = dict(vision_model=True, pad_token_id=7, data_format=data_format, forced_max_seqlen=13)
    vf.gptmodel_forward_model_engine(ref, ids, images, **kw)
    pv.gptmodel_forward_model_engine(ours, ids, images, **kw)
    for r, o in zip(ref.calls, ours.calls, strict=True):
        same_call(r, o)
    assert "other" not in ours.calls[0] and ours.calls[1]["input_ids"].eq(7).any()


def _video_batch(caller_positions: bool):
    """packfwd's Qwen2.5-VL model (tests/test_vision_model.py: text, images, a video 2 s per grid step), the batch,
    transformers' logits per sequence; with ``caller_positions`` the correct ``[3, b, s]`` positions given by the
    caller and the video timing left out of the inputs (so only positions that reach the model give the right
    numbers)."""
    from packfwd.vision import mrope_position_ids

    from .test_vision_model import setup

    _, model, ids, mask, mm, refs = setup("qwen2_5_vl")
    if not caller_positions:
        return model, ids, mask, None, mm, refs
    positions, _ = mrope_position_ids(ids, mask, image_grid_thw=mm["image_grid_thw"],
                                      video_grid_thw=mm["video_grid_thw"], second_per_grid_ts=mm["second_per_grid_ts"],
                                      spatial_merge_size=model.spatial_merge_size,
                                      tokens_per_second=model.tokens_per_second, **model.token_ids)
    return model, ids, mask, positions, {k: v for k, v in mm.items() if k != "second_per_grid_ts"}, refs


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
@pytest.mark.parametrize("positions", ["model", "caller"])
def test_vision_video_equals_transformers(data_format, positions):
    """A Qwen2.5-VL video through the drop-in's vision forward on packfwd's vision model equals transformers per
    sequence: ``second_per_grid_ts`` reaches the model ("model": it computes the positions), and so do the caller's
    ``position_ids`` ("caller": no timing given, the positions carry it).  verl 0.9.1 drops both (2e-3 off)."""
    from .test_vision_model import assert_equal_on_real_tokens

    model, ids, mask, position_ids, mm, refs = _video_batch(positions == "caller")
    with torch.no_grad():
        out = pv.model_forward_gen(vision_model=True)(model, ids, mask, position_ids, mm, data_format=data_format)
    assert_equal_on_real_tokens(out, mask, refs)


def test_vision_timing_and_positions_refused_where_they_cannot_be_used():
    """``second_per_grid_ts`` to a model that takes no such parameter (verl drops it) and positions in verl's own
    ``[b, 4, s]`` layout to packfwd's model: errors that name the fix, not video positions without their timing."""
    b, model = batch(), _video_batch(False)[0]
    timing = {"second_per_grid_ts": torch.tensor([2.0])}
    for forward in (lambda m, mm: pv.model_forward_gen(True)(m, b.ids, b.mask, None, mm),
                    lambda m, mm: pv.gptmodel_forward_model_engine(m, nested(b.ids, b.mask), mm, vision_model=True)):
        with pytest.raises(ValueError, match="takes no second_per_grid_ts"):
            forward(Recorder(), timing)
    verl_layout = torch.zeros(b.ids.shape[0], 4, b.ids.shape[1], dtype=torch.long)
    n, s = b.ids.shape  # [4, b, s] read as k=4, refused in the caller's shape, before the model runs
    with pytest.raises(ValueError, match=rf"position_ids has shape \({n}, 4, {s}\).* takes \[3, {n}, {s}\]"):
        pv.model_forward_gen(True)(model, b.ids, b.mask, verl_layout, {})


LAYOUT_CASES = {  # (tp as parallel_state reports it, the model's config, the forward's arguments)
    "thd_fp8": (1, dict(fp8="e4m3"), dict(data_format="thd")),
    "thd_tp2_fp8": (2, dict(fp8="hybrid"), dict(data_format="thd")),
    "thd_bucket": (1, {}, dict(data_format="thd", pad_to_length_bucket=16)),
    "thd_tp2_bucket": (2, {}, dict(data_format="thd", pad_to_length_bucket=12)),
    "thd_tp2_fp8_bucket": (2, dict(fp8="e4m3"), dict(data_format="thd", pad_to_length_bucket=1024)),
    "bshd_tp2_sp": (2, dict(sequence_parallel=True), dict(data_format="bshd")),
    "bshd_tp2_forced": (2, {}, dict(data_format="bshd", forced_max_seqlen=13)),
    "bshd_tp2_fp8": (2, dict(fp8="e4m3"), dict(data_format="bshd")),
}


@pytest.mark.parametrize("case", list(LAYOUT_CASES))
def test_layout_reaches_model_as_verls(case, monkeypatch):
    """The model gets verl's tensors exactly (ids, masks, positions, PackedSeqParams): alignment to tp, FP8
    padding, length buckets, forced widths, sequence parallelism.  Only the TP size is patched (the stand-in
    model needs no process group)."""
    from megatron.core import parallel_state

    tp, config, kw = LAYOUT_CASES[case]
    monkeypatch.setattr(parallel_state, "get_tensor_model_parallel_world_size", lambda: tp)
    config = dict(config, tensor_model_parallel_size=tp)  # the model's config agrees with parallel_state
    b, ref, ours = batch(), Recorder(**config), Recorder(**config)
    ids = nested(b.ids, b.mask)
    vf.gptmodel_forward_model_engine(ref, ids, {}, **kw)
    pv.gptmodel_forward_model_engine(ours, ids, {}, **kw)
    padded = {k: v for k, v in kw.items() if k == "data_format"}
    if not (kw["data_format"] == "bshd" and config.get("fp8")):  # verl's padded BSHD refuses fp8, as does ours
        vf.model_forward_gen(False)(ref, b.ids, b.mask, b.positions, {}, **padded)
        pv.model_forward_gen(False)(ours, b.ids, b.mask, b.positions, {}, **padded)
    for r, o in zip(ref.calls, ours.calls, strict=True):
        same_call(r, o, ignore=("position_ids",) if "packed_seq_params" in r else ())


def test_text_thd_passes_packed_positions():
    """verl hands the padded [b, s] positions to a packed [1, t] batch; packfwd packs them like the ids."""
    b, ref, ours = batch(), Recorder(), Recorder()
    vf.model_forward_gen(False)(ref, b.ids, b.mask, b.positions, {})
    pv.model_forward_gen(False)(ours, b.ids, b.mask, b.positions, {})
    same_call(ref.calls[0], ours.calls[0], ignore=("position_ids",))
    psp = ours.calls[0]["packed_seq_params"]
    assert torch.equal(psp.cu_seqlens_q, psp.cu_seqlens_q_padded)  # verl's convention
    assert torch.equal(ours.calls[0]["position_ids"], to_thd(b.positions, b.mask)[0][None])


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_integer_mask_is_a_mask(data_format):
    """A 0/1 integer mask works like the bool one (verl's row indexing would read it as column numbers)."""
    b, ref, ours = batch(), Recorder(), Recorder()
    pv.model_forward_gen(False)(ref, b.ids, b.mask, b.positions, {}, data_format=data_format)
    pv.model_forward_gen(False)(ours, b.ids, b.mask.long(), b.positions, {}, data_format=data_format)
    same_call(ref.calls[0], ours.calls[0], ignore=("attention_mask",))


def test_bad_input_names_the_fix():
    b, model = batch(), models().policy
    with pytest.raises(ValueError, match="data_format"):
        pv.model_forward_gen()(model, b.ids, b.mask, b.positions, {}, data_format="sbhd")
    with pytest.raises(TypeError, match="jagged nested"):
        pv.gptmodel_forward_model_engine(model, b.ids, {})
    with pytest.raises(ValueError, match="pad_to_length_bucket"):
        pv.gptmodel_forward_model_engine(model, nested(b.ids, b.mask), {}, pad_to_length_bucket=0)
    with pytest.raises(ValueError, match="cp_layout"):
        pv.gptmodel_forward_model_engine(model, nested(b.ids, b.mask), {}, cp_layout="ring")
    with pytest.raises(NotImplementedError, match="dynamic context parallelism"):  # Megatron-Core 0.16 has none
        pv.gptmodel_forward_model_engine(model, nested(b.ids, b.mask), {}, local_cp_size=2)


from packfwd.testing import run_local


@pytest.mark.parametrize("tp, cp", [(2, 1), (1, 2)], ids=["tp2_sp", "cp2"])
def test_parallel_matches_verl(tp, cp):
    """Real TP=2 (with sequence parallelism) and CP=2 worlds; every rank compares on its own shard."""
    results = run_local(rank_cases, tp * cp, tp, cp, backend="gloo", timeout=300)
    assert all(r["cases"].keys() == results[0]["cases"].keys() for r in results)


# ---------------------------------------------------------------------------------------- scored tokens only


def _weighted_run(fn, model, keep):
    """``fn()``'s outputs (detached) and the parameter gradients of a fixed weighted sum of them over ``keep``."""
    model.zero_grad(set_to_none=True)
    out = fn()
    flat = {k: v.values() if v.is_nested else v for k, v in out.items()}
    total = 0.0
    for v in flat.values():
        w = torch.linspace(-1.0, 1.0, v.numel()).view(v.shape)
        total = total + (v * w * keep.reshape(*keep.shape, *[1] * (v.dim() - keep.dim()))).sum()
    total.backward()
    return {k: v.detach() for k, v in flat.items()}, {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_scored_tokens_match_verl_there_and_are_zero_elsewhere(data_format):
    """packfwd.verl's default: only the tokens verl's losses read go through the head (``model_forward_gen``: its
    ``label_mask``; the engine: the loss mask one token later, as verl's losses roll it onto the log-probs); there
    the outputs and gradients are verl's, elsewhere every output is exactly 0 (the logits a processor returns too)."""
    b, model = batch(), models().policy
    ref_model, our_model = views(model, data_format)
    kw = dict(data_format=data_format, logits_processor=log_prob_processor,
              logits_processor_args=dict(label=b.labels, label_mask=b.label_mask, temperature=b.temperature))
    keep = b.label_mask & b.mask
    engine_keep = torch.zeros_like(b.mask)
    engine_keep[:, :-1] = (torch.cat([torch.zeros_like(b.mask[:, :5]), b.response_mask], 1) & b.mask)[:, 1:]
    ids, engine_keep = nested(b.ids, b.mask), engine_keep[b.mask]
    ekw = dict(data_format=data_format, logits_processor=engine_processor)
    for ref, ours, kept in [
        (lambda: vf.model_forward_gen(False)(ref_model, b.ids, b.mask, b.positions, {}, **kw),
         lambda: pv.model_forward_gen(False)(our_model, b.ids, b.mask, b.positions, {}, **kw), keep),
        (lambda: vf.gptmodel_forward_model_engine(ref_model, ids, {}, logits_processor_args=engine_args(b), **ekw),
         lambda: pv.gptmodel_forward_model_engine(our_model, ids, {}, logits_processor_args=engine_args(b), **ekw),
         engine_keep)]:
        assert 0 < int(kept.sum()) < int(b.mask.sum())
        want, want_grads = _weighted_run(ref, model, kept)
        got, grads = _weighted_run(ours, model, kept)
        for k in want:
            torch.testing.assert_close(got[k][kept], want[k][kept], **OUT_TOL)
            assert not got[k][~kept].any(), k
        assert want["logits" if "logits" in want else "log_probs"][~kept].any()  # verl has numbers there
        for name in want_grads:
            torch.testing.assert_close(grads[name], want_grads[name], atol=1e-5, rtol=1e-4, msg=name)
