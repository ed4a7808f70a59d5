"""``packfwd.verl``'s forwards with MTP training, against verl 0.9.1's own forwards and verl's own MTP patch.

Strategy: verl's ``model_forward_gen`` / ``gptmodel_forward_model_engine`` run on a packfwd MTP model to which
verl's own ``patch_postprocess`` (``verl/models/mcore/mtp_patch.py``, loaded from the installed verl) is applied,
as verl's engine applies it: the model gets verl's packed labels and loss mask and computes the MTP loss with
Megatron-Core's roll.  In verl's THD layout without CP the roll stays inside each sequence (verl's
``cu_seqlens_q`` are the padded offsets), and with every sequence starting with a prompt token (loss mask 0) the
labels that verl's engine rolls across sequence boundaries are masked; there verl's numbers are right and
packfwd.verl (unpatched model, labels shifted within each sequence, ``packfwd.verl.mtp``) must equal them:
outputs, parameter gradients (the MTP loss hung on the backward, the output layer detached as verl's legacy
branch does on this Megatron-Core) and the per-depth losses verl's engine reads from Megatron-Core's tracker.
BSHD (which verl's padded forward runs without MTP) is checked against packfwd's own THD.

Tolerances as in test_verl_dropin.py (float32 ``1e-5``; the differences seen are rounding of the cross entropy).
"""

from __future__ import annotations

import dataclasses
import functools

import pytest
import torch

import packfwd.verl as pv
from packfwd.verl.mtp import legacy_verl
from packfwd.layout.rules import local_positions
from packfwd.models import build_model

from .verl_dropin_support import (ARGS, batch, compare, engine_args, engine_processor, last_tokens, log_prob_processor,
                                  nested, run, vf)
from .verl_forward_ref import MtpConfig
from .verl_ref import load_with_stubs

pytestmark = pytest.mark.skipif(vf is None, reason="verl is not installed (make test installs it with --no-deps)")

MTP_ARGS = dataclasses.replace(ARGS, mtp_num_layers=2)
ON = MtpConfig(enable=True, enable_train=True)


@pytest.fixture(autouse=True)
def one_process_world():
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()


@functools.cache
def verl_mtp_patch():
    import importlib.util

    root = importlib.util.find_spec("verl").submodule_search_locations[0]
    return load_with_stubs(f"{root}/models/mcore/mtp_patch.py", "packfwd_ref_verl_mtp_patch", {})


@functools.cache
def mtp_model():
    torch.manual_seed(0)
    return build_model(MTP_ARGS).eval()  # eval: no tracker logging (CUDA buffers) unless a test asks for it


class VerlView(torch.nn.Module):
    """The packfwd model as verl's engine holds it: ``_postprocess`` patched by verl's ``patch_postprocess``
    while a call runs, and the padded ``[b, s]`` positions verl passes with a packed batch replaced by each
    token's position in its sequence (Megatron-Core's RoPE ignores them; its MTP roll needs a tensor)."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, packed_seq_params=None, **kwargs):
        if packed_seq_params is not None and input_ids is not None:
            position_ids = local_positions(packed_seq_params.cu_seqlens_q_padded, input_ids.shape[1], 1, 0)[None]
        patch = verl_mtp_patch()
        patch.patch_postprocess(self.module)
        try:
            return self.module(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                               packed_seq_params=packed_seq_params, **kwargs)
        finally:
            patch.unpatch_postprocess(self.module)
            del self.module._postprocess  # back to the class's method
            del self.module._postprocess_backup


def test_model_forward_thd_matches_verl():
    b, model = batch(), mtp_model()
    kw = dict(logits_processor=log_prob_processor, mtp_config=ON,
              logits_processor_args=dict(label=b.labels, label_mask=b.label_mask, temperature=b.temperature))
    ref = functools.partial(vf.model_forward_gen(False), VerlView(model), b.ids, b.mask, b.positions, {}, **kw)
    ours = functools.partial(pv.model_forward_gen(False, scored_only=False), model, b.ids, b.mask, b.positions, {},
                             **kw)
    compare(ref, ours, [model])
    _, with_mtp = run(ours, [model])
    _, without = run(functools.partial(ours, mtp_config=MtpConfig(enable=True)), [model])
    assert any(k.startswith("0.mtp.") for k in with_mtp) and not any(k.startswith("0.mtp.") for k in without)
    head = "0.output_layer.weight"
    if legacy_verl():  # verl's branch for Megatron-Core without process_mtp_loss detaches the output layer
        torch.testing.assert_close(with_mtp[head], without[head], atol=1e-6, rtol=1e-6)
    else:  # with it (0.19) the MTP loss reaches the output layer unless the config says mtp_detach_heads
        assert not torch.allclose(with_mtp[head], without[head], atol=1e-6, rtol=1e-6)


def test_engine_thd_matches_verl():
    b, model = batch(), mtp_model()
    ids, last = nested(b.ids, b.mask), last_tokens(b)
    kw = dict(logits_processor=engine_processor, mtp_enable_train=True)
    ref = lambda: vf.gptmodel_forward_model_engine(VerlView(model), ids, {}, logits_processor_args=engine_args(b), **kw)
    ours = lambda: pv.gptmodel_forward_model_engine(model, ids, {}, logits_processor_args=engine_args(b),
                                                    scored_only=False, **kw)
    compare(ref, ours, [model], keep=(~last).float(), skip=last)


def test_tracker_records_verls_per_depth_losses():
    """Training mode: the per-depth mean MTP loss that verl's engine reads from Megatron-Core's tracker."""
    from megatron.core.transformer.multi_token_prediction import MTPLossLoggingHelper

    from packfwd.models.runtime.cpu import host_collectives

    b, model = batch(), mtp_model()
    kw = dict(logits_processor=log_prob_processor, mtp_config=ON,
              logits_processor_args=dict(label=b.labels, label_mask=b.label_mask, temperature=b.temperature))
    tracker = MTPLossLoggingHelper.tracker
    key = "values" if hasattr(MTPLossLoggingHelper, "save_loss_to_tracker") else "loss_values"
    seen = []
    model.train()
    try:
        for forward, m in ((vf.model_forward_gen(False), VerlView(model)), (pv.model_forward_gen(False), model)):
            tracker.clear()
            with host_collectives():  # the tracker allocates on the current CUDA device
                forward(m, b.ids, b.mask, b.positions, {}, **kw)
            seen.append(tracker[key].clone())
    finally:
        model.eval()
        tracker.clear()
    assert seen[0].shape == (2,) and bool((seen[0] > 0).all())
    torch.testing.assert_close(seen[1], seen[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("engine", [False, True], ids=["model_forward", "engine"])
def test_bshd_equals_thd(engine):
    """verl's BSHD forwards train no MTP (the padded one passes no labels); packfwd's do, as its THD ones."""
    b, model = batch(), mtp_model()

    def call(data_format):
        if engine:
            return pv.gptmodel_forward_model_engine(model, nested(b.ids, b.mask), {}, data_format=data_format,
                                                    logits_processor=engine_processor, mtp_enable_train=True,
                                                    logits_processor_args=engine_args(b))
        return pv.model_forward_gen(False)(model, b.ids, b.mask, b.positions, {}, data_format=data_format,
                                           logits_processor=log_prob_processor, mtp_config=ON,
                                           logits_processor_args=dict(label=b.labels, label_mask=b.label_mask,
                                                                      temperature=b.temperature))

    compare(lambda: call("thd"), lambda: call("bshd"), [model])


def test_engine_loss_mask_is_verls():
    """The engine's MTP loss mask (prompt zeros, then the response mask) as verl's own helper builds it, from a
    jagged response mask and from a padded one with its attention mask (a prompt-only sequence included)."""
    b = batch()
    ids = nested(b.ids, b.mask)
    lengths = b.mask.sum(1).tolist()
    responses = torch.tensor([3, 0, 1, 4])
    response_attention = torch.arange(6) < responses[:, None]
    response_mask = response_attention & (torch.rand(4, 6, generator=torch.Generator().manual_seed(2)) < 0.7)
    jagged = torch.nested.nested_tensor([response_mask[i, : responses[i]] for i in range(4)], layout=torch.jagged)
    for loss_mask, attention in ((jagged, None), (response_mask, response_attention)):
        want = vf._build_mtp_loss_mask_nested(loss_mask, lengths, attention)
        got = pv.mtp.engine_loss_mask(ids, loss_mask, attention)
        assert torch.equal(got.values(), want.values()) and torch.equal(got.offsets(), want.offsets())


def test_mtp_arguments_name_the_fix():
    b, model = batch(), mtp_model()
    forward = pv.model_forward_gen(False)
    with pytest.raises(ValueError, match="label_mask"):
        forward(model, b.ids, b.mask, b.positions, {}, mtp_config=ON, logits_processor_args={"label": b.labels})
    detach = dataclasses.make_dataclass("Cfg", [("enable_train", bool, True), ("detach_encoder", bool, True)])()
    with pytest.raises(NotImplementedError, match="detach_encoder"):
        forward(model, b.ids, b.mask, b.positions, {}, mtp_config=detach,
                logits_processor_args=dict(label=b.labels, label_mask=b.label_mask))
    with pytest.raises(ValueError, match="loss_mask"):
        pv.gptmodel_forward_model_engine(model, nested(b.ids, b.mask), {}, mtp_enable_train=True,
                                         logits_processor_args={"label": nested(b.ids, b.mask)})
    verl_mtp_patch().patch_postprocess(model)
    try:
        with pytest.raises(ValueError, match="patch"):
            forward(model, b.ids, b.mask, b.positions, {}, mtp_config=ON,
                    logits_processor_args=dict(label=b.labels, label_mask=b.label_mask))
    finally:
        del model._postprocess, model._postprocess_backup
