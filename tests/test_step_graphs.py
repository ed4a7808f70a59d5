"""The step's buckets and its graphed path, on the CPU (``packfwd.micro.buckets``, ``packfwd.micro.graphs``).

Strategy: the bucket shapes are checked as properties over random plans (each micro-batch fits its bucket, padded
by less than ``max_tokens / bucket_steps`` tokens, at most ``bucket_steps`` sizes, one row count per rank, sizes
valid for ``plan_thd_bucket``).  The bucketed step is run without graphs (``StepGraphs(capture=False)``, or
``buckets=True``: the same padded rows and spare sequences that the CUDA graphs replay) against the plain eager step
in float64: outputs, losses under each normalisation and gradients agree to rounding, so padding never changes a
real token's result nor the loss normalisation.  The default on the CPU is today's eager path, bit for bit, and
every case graphs cannot take is named.  The graphed path's bookkeeping (warm-up, capture, replays that overwrite
static outputs, the captured backward's gradients, recapture, a failed capture) runs with a CPU stand-in for a CUDA
graph that recomputes on replay, against the padded eager steps bit for bit.  ``buckets=None`` (the default) pads
only where it was measured to pay (``padding_pays``: a CUDA batch, cuDNN's attention on bucket plans alone), each
case named.  An MoE model's padded step equals its plain step and routes no pad.  The CUDA graphs themselves:
``tests/gpu/test_step_graphs_cuda.py``.
"""

import functools
import math

import numpy as np
import pytest
import torch

import packfwd as pf
from packfwd.logits import log_probs_and_entropy
from packfwd.micro import StepGraphs, plan_micro_batches, run_micro_batches
from packfwd.micro import graphs as graphs_module
from packfwd.micro.graphs import why_eager


@pytest.mark.parametrize("seed", range(6))
def test_buckets_fit_with_bounded_padding_and_few_shapes(seed):
    rng = np.random.default_rng(seed)
    tp, cp = [(1, 1), (2, 1), (2, 2), (1, 4)][seed % 4]
    lengths = rng.integers(1, 900, size=int(rng.integers(20, 200))).tolist()
    steps = [16, 8, 4][seed % 3]
    plan = plan_micro_batches(lengths, max_tokens=1024, dp_size=2, tp_size=tp, cp_size=cp, bucket_steps=steps)
    align = plan.seq_align
    period = math.lcm(align, tp * cp)
    unit = -(-(1024 * cp // period * period) // steps)
    for r in range(plan.dp_size):
        shapes = plan.buckets(r)
        rows = {s[0] for s, mb in zip(shapes, plan.micro_batches[r]) if mb}
        assert len(rows) == 1  # one row count per rank
        sizes = {s[1] for s, mb in zip(shapes, plan.micro_batches[r]) if mb}
        assert len(sizes) <= steps
        for (n, t), mb, used in zip(shapes, plan.micro_batches[r], plan.tokens[r]):
            if not mb:
                assert (n, t) == (0, 0)
                continue
            assert n >= len(mb) and n & (n - 1) == 0  # a power of two, every row fits
            assert used <= t <= 1024 and (t - used) * cp < unit + period, (t, used, unit)
            assert t * cp % period == 0  # plan_thd_bucket's rule for Bucket.tokens
            pf.layout.bucket.plan_thd_bucket(  # the bucket holds the micro-batch's own layout
                torch.arange(1000)[None] < torch.tensor([lengths[i] for i in mb])[:, None],
                pf.layout.bucket.Bucket(t * cp, -(-1000 // align) * align), tp_size=tp, cp_size=cp, cp_rank=0,
                seq_align=align)


def test_bucket_steps_is_checked():
    with pytest.raises(ValueError, match="bucket_steps"):
        plan_micro_batches([3, 4], max_tokens=8, bucket_steps=0)


def _setup(dtype=torch.float64, width=16, max_tokens=40):
    import transformers

    from packfwd.models import from_hf

    torch.manual_seed(0)
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)).to(dtype)
    model = from_hf(hf, params_dtype=dtype)
    g = torch.Generator().manual_seed(1)
    seqlens = torch.randint(1, width, (10,), generator=g).tolist()
    ids = torch.randint(1, 128, (10, width), generator=g)
    start = torch.randint(0, 3, (10,), generator=g)  # some rows left-padded
    col = torch.arange(width)[None]
    mask = (col >= start[:, None]) & (col < (start + torch.tensor(seqlens)).clamp(max=width)[:, None])
    seqlens = mask.sum(1).tolist()
    labels = pf.next_token_labels(ids, mask)
    loss_mask = (labels >= 0) & (col >= 3)
    adv = torch.randn(10, generator=g, dtype=dtype)
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    plan = plan_micro_batches(seqlens, max_tokens=max_tokens, **forward.layout.plan_args)
    return model, forward, plan, dict(ids=ids, mask=mask, labels=labels, loss_mask=loss_mask, adv=adv)


def _step(model, forward, plan, d, graphs, normalize="token_mean", grad=True, **options):
    model.zero_grad(set_to_none=True)
    kw = dict(loss_fn=lambda o, adv: -o["log_probs"] * adv[:, None] + 0.1 * o["entropy"], loss_args={"adv": d["adv"]},
              loss_mask=d["loss_mask"], normalize=normalize) if grad else {}
    with torch.set_grad_enabled(grad):
        out = run_micro_batches(forward, model, plan, d["ids"], d["mask"], dp_rank=0, graphs=graphs,
                                labels=d["labels"], **kw, **options)
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("normalize", ["token_mean", "sequence_mean", "sum"])
def test_bucketed_step_equals_the_eager_step(normalize):
    model, forward, plan, d = _setup()
    plain, plain_grads = _step(model, forward, plan, d, False, normalize)
    graphs = StepGraphs(capture=False)
    seen = []
    original = forward.plan
    forward.plan = lambda *a, **k: seen.append(k["bucket"]) or original(*a, **k)  # the bucket plans it made
    got, grads = _step(model, forward, plan, d, graphs, normalize)
    forward.plan = original
    assert graphs.reason is None and graphs.eager == plan.num_micro_batches == len(seen) >= 2, graphs
    assert [b.tokens for b in seen] == [t for _, t in plan.buckets(0)]
    assert any(t > used for (_, t), used in zip(plan.buckets(0), plan.tokens[0])), "no bucket adds padding"
    torch.testing.assert_close(got.loss, plain.loss, rtol=1e-12, atol=1e-14)
    for k in plain.outputs:
        torch.testing.assert_close(got.outputs[k], plain.outputs[k], rtol=1e-12, atol=1e-13)
    assert grads.keys() == plain_grads.keys()
    for n in grads:
        torch.testing.assert_close(grads[n], plain_grads[n], rtol=1e-10, atol=1e-13)
    # the same bucketed step again: the static inputs are refilled, nothing of the first step is kept
    again, again_grads = _step(model, forward, plan, d, graphs, normalize)
    assert torch.equal(again.loss, got.loss) and all(torch.equal(again_grads[n], grads[n]) for n in grads)
    # control: these tolerances see a change of one part in a million in the loss's inputs
    d2 = dict(d, adv=d["adv"] * 1.000001)
    other, _ = _step(model, forward, plan, d2, graphs, normalize)
    assert not torch.allclose(other.loss, plain.loss, rtol=1e-12, atol=1e-14)


def test_bucketed_forward_only_equals_the_eager_forward():
    model, forward, plan, d = _setup(torch.float32)
    plain, _ = _step(model, forward, plan, d, False, grad=False)
    got, _ = _step(model, forward, plan, d, StepGraphs(capture=False), grad=False)
    for k in plain.outputs:
        torch.testing.assert_close(got.outputs[k], plain.outputs[k], rtol=1e-5, atol=1e-5)


def test_the_default_on_the_cpu_is_the_eager_step_bit_for_bit():
    model, forward, plan, d = _setup(torch.float32)
    default, default_grads = _step(model, forward, plan, d, True)
    off, off_grads = _step(model, forward, plan, d, False)
    assert torch.equal(default.loss, off.loss)
    assert all(torch.equal(default.outputs[k], off.outputs[k]) for k in off.outputs)
    assert all(torch.equal(default_grads[n], off_grads[n]) for n in off_grads)
    assert getattr(forward, "step_graphs", None) is None  # nothing captured, nothing held on the CPU
    graphs = StepGraphs()  # asked for graphs on the CPU: the eager step, and why
    mine, _ = _step(model, forward, plan, d, graphs)
    assert torch.equal(mine.loss, off.loss) and graphs.eager == 0 and "CUDA" in graphs.reason
    with pytest.raises(TypeError, match="graphs must be"):
        _step(model, forward, plan, d, "yes")


def test_what_graphs_cannot_take_is_named():
    model, forward, _, d = _setup(torch.float32)
    ids = d["ids"]
    assert why_eager(forward, model, ids, cuda=False) is None
    wrapped = functools.wraps(forward)(lambda *a, **k: forward(*a, **k))
    assert "make_forward" in why_eager(wrapped, model, ids, cuda=False)
    assert "layout" in why_eager(pf.make_forward("bshd"), model, ids, cuda=False)
    assert "no logits processor" in why_eager(pf.make_forward("thd"), model, ids, cuda=False)
    assert "routing" in why_eager(pf.make_forward("thd", record_routing=True), model, ids, cuda=False)
    assert "pipeline" in why_eager(forward, model, ids, pp_group=object(), cuda=False)
    assert "CUDA" in why_eager(forward, model, ids)
    handle = model.decoder.layers[0].register_forward_hook(lambda *a: None)
    try:
        assert "hooks" in why_eager(forward, model, ids, cuda=False)
    finally:
        handle.remove()
    det = pf.make_forward("thd", deterministic=True, logits_processor=log_probs_and_entropy)  # its own guard
    assert why_eager(det, model, ids, cuda=False) is None


class FakeGraph:
    """A CUDA graph's contract on the CPU: capturing runs ``fn`` once and keeps what it returned; ``replay()``
    recomputes ``fn`` into those same tensors (so every replay overwrites the last one's outputs)."""

    def __init__(self, fn):
        self.fn, self.result = fn, fn()

    def replay(self):
        new = self.fn()
        with torch.no_grad():
            for static, value in zip(self.result, new):
                if static is not None:
                    static.copy_(value)


class CpuDevice(graphs_module._Device):
    """The graphs' device calls on the CPU: no streams, no pool, FakeGraph for a capture."""

    takes = staticmethod(lambda x: True)
    stream = staticmethod(lambda: None)
    pool = staticmethod(lambda: None)
    run_on = staticmethod(lambda stream, fn: fn())
    reserved = staticmethod(lambda settle=False: 0)

    @staticmethod
    def record(fn, pool, stream):
        graph = FakeGraph(fn)
        return graph, graph.result


@pytest.fixture
def cpu_graphs(monkeypatch):
    monkeypatch.setattr(graphs_module, "_DEVICE", CpuDevice())


@pytest.mark.parametrize("grad", [True, False], ids=["fwd+bwd", "forward-only"])
def test_replayed_steps_equal_the_padded_eager_steps(cpu_graphs, grad):
    """The graphed path's bookkeeping with graphs that recompute (no GPU): warm-up, capture, replays over two steps,
    static outputs cloned before the next replay, gradients through the captured backward into ``.grad``: the
    bits of the same padded steps run eagerly; a parameter replaced is captured again; a failed capture warns
    once and stays eager."""
    model, forward, plan, d = _setup()
    eager, eager_grads = _step(model, forward, plan, d, StepGraphs(capture=False, head_quarters=True), grad=grad)
    graphs = StepGraphs()
    for _ in range(2):
        got, got_grads = _step(model, forward, plan, d, graphs, grad=grad)
        assert torch.equal(got.loss, eager.loss)
        assert all(torch.equal(got.outputs[k], eager.outputs[k]) for k in eager.outputs)
        assert got_grads.keys() == eager_grads.keys() and all(torch.equal(got_grads[n], eager_grads[n])
                                                            for n in eager_grads)
    buckets = len(set(plan.buckets(0)))
    assert graphs.reason is None and buckets <= graphs.captured <= 4 * buckets, graphs
    assert graphs.replayed >= plan.num_micro_batches and graphs.eager == graphs.captured, graphs  # one warm-up each
    if not grad:
        return
    written = [e.graphs[4] for e in graphs._entries.values() if e.graphs is not None]
    assert len(written) >= 2 and all(a is b for other in written[1:] for a, b in zip(written[0], other)
                                     if a is not None and b is not None), "one set of gradient buffers for all"
    with torch.no_grad():  # a parameter replaced: its buckets capture again, with the new values
        first = next(model.parameters())
        first.data = first.data * 1.5
    captured = graphs.captured
    got, got_grads = _step(model, forward, plan, d, graphs)
    want, want_grads = _step(model, forward, plan, d, StepGraphs(capture=False, head_quarters=True))
    assert graphs.captured > captured and torch.equal(got.loss, want.loss)
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)


def test_a_failed_capture_warns_once_and_stays_eager(cpu_graphs, monkeypatch):
    def refuse(fn, pool, stream):
        raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setattr(graphs_module._DEVICE, "record", refuse)
    model, forward, plan, d = _setup()
    want, want_grads = _step(model, forward, plan, d, StepGraphs(capture=False, head_quarters=True))
    graphs = StepGraphs()
    with pytest.warns(UserWarning, match="could not capture") as caught:
        for _ in range(3):  # the third step tries no capture: its buckets stay eager, and say why
            got, got_grads = _step(model, forward, plan, d, graphs)
    assert sum("could not capture" in str(w.message) for w in caught) == 1
    assert graphs.captured == 0 and graphs.reason.startswith("capture failed: RuntimeError"), graphs
    assert torch.equal(got.loss, want.loss) and all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)


def test_graphs_none_graphs_where_they_work_and_is_quiet_where_they_cannot(cpu_graphs):
    """``graphs=None``: where graphs can work, the forward's own graphs capture and replay (the bits of
    ``graphs=True``); where they cannot (a module hook here), the plain eager step without a warning, the reason kept
    on ``forward.step_graphs``; ``graphs=True`` says the same reason in a warning."""
    import warnings

    model, forward, plan, d = _setup()
    want, want_grads = _step(model, forward, plan, d, True)
    model2, forward2, _, _ = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            got, got_grads = _step(model2, forward2, plan, d, None)
    assert not [w for w in caught if "packfwd" in str(w.message)]
    held = forward2.step_graphs
    assert held.reason is None and held.captured >= 1 and held.replayed >= 1, held
    assert torch.equal(got.loss, want.loss) and all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)

    model3, forward3, _, _ = _setup()
    plain, plain_grads = _step(model3, forward3, plan, d, False)
    model3.register_forward_hook(lambda m, a, o: None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        quiet, quiet_grads = _step(model3, forward3, plan, d, None)
    assert not [w for w in caught if "packfwd" in str(w.message)]
    assert "hooks" in forward3.step_graphs.reason and forward3.step_graphs.captured == 0
    assert torch.equal(quiet.loss, plain.loss) and all(torch.equal(quiet_grads[n], plain_grads[n])
                                                       for n in plain_grads)
    with pytest.warns(UserWarning, match="without CUDA graphs: module .* has hooks"):
        _step(model3, forward3, plan, d, True)


def test_inference_mode_and_frozen_parameters_get_buckets_of_their_own(cpu_graphs):
    """A bucket captured under inference mode holds inference tensors, which a later call outside it could not
    refill; one captured with other parameters taking gradients returns gradients for those: each is a bucket of
    its own, and the results stay the padded eager steps'."""
    model, forward, plan, d = _setup()
    graphs = StepGraphs()
    with torch.inference_mode():
        first = run_micro_batches(forward, model, plan, d["ids"], d["mask"], dp_rank=0, graphs=graphs,
                                  labels=d["labels"])
    with torch.no_grad():
        second = run_micro_batches(forward, model, plan, d["ids"], d["mask"], dp_rank=0, graphs=graphs,
                                   labels=d["labels"])
    assert all(torch.equal(first.outputs[k], second.outputs[k]) for k in first.outputs)
    _step(model, forward, plan, d, graphs)
    for p in model.decoder.parameters():
        p.requires_grad_(False)
    got, got_grads = _step(model, forward, plan, d, graphs)
    want, want_grads = _step(model, forward, plan, d, StepGraphs(capture=False, head_quarters=True))
    assert torch.equal(got.loss, want.loss) and got_grads.keys() == want_grads.keys()
    assert all(torch.equal(got_grads[n], want_grads[n]) for n in want_grads)


def test_batches_of_another_width_share_the_buckets(cpu_graphs):
    """A bucket's canvas is the batch's width rounded up (``WIDTH_STEP``): the same sequences padded to a wider
    batch replay the graphs captured for the narrower one, with the same numbers in the real columns."""
    model, forward, plan, d = _setup()
    graphs = StepGraphs()
    for _ in range(2):
        narrow, narrow_grads = _step(model, forward, plan, d, graphs)
    captured = graphs.captured
    wide = {k: torch.nn.functional.pad(v, (0, 5)) if v.dim() == 2 else v for k, v in d.items()}
    wide["labels"][:, 16:] = -100
    got, got_grads = _step(model, forward, plan, wide, graphs)
    assert graphs.captured == captured, graphs  # nothing captured again
    torch.testing.assert_close(got.loss, narrow.loss, rtol=1e-14, atol=0)  # the eager loss sums 21 columns, not 16
    assert all(torch.equal(got_grads[n], narrow_grads[n]) for n in narrow_grads)
    for k in narrow.outputs:
        assert got.outputs[k].shape[1] == 21 and torch.equal(got.outputs[k][:, :16], narrow.outputs[k]), k


def test_buckets_true_pads_every_micro_batch_and_none_on_the_cpu_does_not():
    model, forward, plan, d = _setup()
    plain, plain_grads = _step(model, forward, plan, d, False, buckets=False)
    default, default_grads = _step(model, forward, plan, d, False)  # buckets=None on the CPU: the plain step
    assert torch.equal(default.loss, plain.loss) and all(torch.equal(default_grads[n], plain_grads[n]) for n in plain_grads)
    assert forward.padded_steps.eager == 0 and "not a CUDA batch" in forward.padded_steps.reason
    elsewhere, _ = _step(model, forward, plan, d, StepGraphs(capture=False))  # the padded step, held elsewhere: other
    assert not torch.equal(elsewhere.loss, plain.loss)  # bits, so the equalities above tell the two steps apart
    assert forward.padded_steps.eager == 0

    def step(graphs, **kw):
        model.zero_grad(set_to_none=True)
        out = run_micro_batches(forward, model, plan, d["ids"], d["mask"], dp_rank=0, graphs=graphs,
                                labels=d["labels"], loss_fn=lambda o: -o["log_probs"], loss_mask=d["loss_mask"], **kw)
        return out, {n: p.grad.clone() for n, p in model.named_parameters()}

    padded, grads = step(False, buckets=True)
    assert forward.padded_steps.reason is None and forward.padded_steps.eager == plan.num_micro_batches
    same, same_grads = step(StepGraphs(capture=False))  # the same padded steps, held elsewhere: the same bits
    assert torch.equal(padded.loss, same.loss) and all(torch.equal(grads[n], same_grads[n]) for n in grads)
    assert all(torch.equal(padded.outputs[k], same.outputs[k]) for k in same.outputs)
    off, off_grads = step(False, buckets=False)
    torch.testing.assert_close(padded.loss, off.loss, rtol=1e-12, atol=1e-14)  # float64: padding only rounds
    for n in grads:
        torch.testing.assert_close(grads[n], off_grads[n], rtol=1e-10, atol=1e-13)
    with pytest.raises(ValueError, match="buckets=False refuses"):
        step(True, buckets=False)
    with pytest.raises(TypeError, match="buckets must be"):
        step(False, buckets="yes")


def test_buckets_none_pads_where_padding_was_measured_to_pay(monkeypatch):
    from packfwd.micro import step as step_module
    from packfwd.models.mixers import attention

    model, forward, plan, d = _setup()
    ids = d["ids"]
    assert step_module.padding_pays(model, ids) == "not a CUDA batch: no attention kernel here plans per shape"
    monkeypatch.setattr(step_module, "capturable", lambda x: True)  # a CUDA batch, as far as the rule reads
    said = step_module.padding_pays(model, ids)
    assert "not cuDNN" in said and "nvidia-cudnn-frontend" in said  # no cuDNN here

    def with_cudnn(m, *, bucket_plans=False):  # cuDNN checked on the device: taken for bucket plans only
        return {"cudnn" if bucket_plans else "torch_varlen": 2}

    monkeypatch.setattr(attention, "attention_backends", with_cudnn)
    assert step_module.padding_pays(model, ids) is None
    monkeypatch.setattr(attention, "attention_backends", lambda m, *, bucket_plans=False: {"cudnn": 2})
    assert step_module.padding_pays(model, ids) is None  # built with cuDNN: its shapes should recur too
    monkeypatch.setattr(attention, "attention_backends", with_cudnn)
    monkeypatch.setattr(model.config, "num_moe_experts", 8)  # an MoE model pads too (history 22: 1.04 x)
    assert step_module.padding_pays(model, ids) is None
    monkeypatch.setattr(model.config, "num_moe_experts", None)
    model.zero_grad(set_to_none=True)  # and the default then pads (the padded step itself runs on the CPU)
    run_micro_batches(forward, model, plan, ids, d["mask"], dp_rank=0, labels=d["labels"],
                      loss_fn=lambda o: -o["log_probs"], loss_mask=d["loss_mask"])
    assert forward.padded_steps.reason is None and forward.padded_steps.eager == plan.num_micro_batches


def test_padded_steps_refuse_processor_inputs_that_take_gradients_and_forget_old_buckets_quietly(monkeypatch):
    """A processor tensor with requires_grad would lose its gradient in the padded step's static copy: the plain
    step runs (it gets its gradient), the reason named; past max_graphs the padded steps drop their oldest bucket
    without the graphs' warning."""
    import warnings

    from packfwd.logits import log_probs

    model, forward, plan, d = _setup()
    temperature = (1 + torch.rand(10, 16, dtype=torch.float64)).requires_grad_()  # per token, learned

    def tempered(logits, labels, temperature):
        return {"log_probs": log_probs(logits / temperature[:, None], labels)}

    tempered_forward = pf.make_forward("thd", logits_processor=tempered)
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match="take gradients"):
        run_micro_batches(tempered_forward, model, plan, d["ids"], d["mask"], dp_rank=0, labels=d["labels"],
                          loss_fn=lambda o: -o["log_probs"], loss_mask=d["loss_mask"], buckets=True,
                          temperature=temperature)
    assert "take gradients" in tempered_forward.padded_steps.reason and tempered_forward.padded_steps.eager == 0
    assert temperature.grad is not None and temperature.grad.abs().sum() > 0  # the plain step: its gradient
    held = StepGraphs(capture=False, max_graphs=1)
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        for width in (16, 300):  # two canvases: two buckets for a cache of one
            ids = torch.nn.functional.pad(d["ids"], (0, width - 16))
            mask = torch.nn.functional.pad(d["mask"], (0, width - 16))
            labels = torch.nn.functional.pad(d["labels"], (0, width - 16), value=-100)
            run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels, graphs=held)
    assert len(held._entries) == 1 and held.eager == 2 * plan.num_micro_batches
    assert not [w for w in said if "max_graphs" in str(w.message)]  # no "captured again" for steps capturing nothing


def test_activation_recompute_is_named_for_graphs_and_padded_steps_still_run(monkeypatch):
    """Megatron-Core's checkpointing refuses ``torch.autograd.grad``, which the graphs' backward is: graphs name it;
    the padded eager steps run plain autograd, so they take such a model, with the plain step's numbers."""
    model, forward, plan, d = _setup()
    plain, plain_grads = _step(model, forward, plan, d, False, buckets=False)  # before recompute is switched on
    for name, value in (("recompute_granularity", "full"), ("recompute_method", "uniform"),
                        ("recompute_num_layers", 1)):
        monkeypatch.setattr(model.config, name, value)
    assert "activation recompute" in why_eager(forward, model, d["ids"], cuda=True)
    assert why_eager(forward, model, d["ids"], cuda=False) is None
    from megatron.core.tensor_parallel import random as megatron_random

    # Megatron-Core's checkpoint saves and restores the CUDA generator's state; this model draws no random number
    # (no dropout), so on the CPU the host generator's state stands in for it
    monkeypatch.setattr(megatron_random, "_get_all_rng_states", lambda: (torch.get_rng_state(), None, None))
    monkeypatch.setattr(megatron_random, "_set_all_rng_states", lambda cpu, cuda, tracker: torch.set_rng_state(cpu))
    calls = []
    layer = model.decoder.layers[0]
    original = layer.forward  # an instance attribute, not a hook (a hooked model runs the plain step)
    monkeypatch.setattr(layer, "forward", lambda *a, **k: calls.append(1) or original(*a, **k))
    padded, padded_grads = _step(model, forward, plan, d, False, buckets=True)
    assert forward.padded_steps.reason is None and forward.padded_steps.eager == plan.num_micro_batches
    assert len(calls) == 2 * plan.num_micro_batches  # each micro-batch's layer ran again in its backward
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-12, atol=1e-14)  # float64: padding only rounds
    for n in plain_grads:
        torch.testing.assert_close(padded_grads[n], plain_grads[n], rtol=1e-10, atol=1e-13)


def test_padded_eager_steps_keep_one_entry_per_bucket_whatever_the_head_size():
    """A padded eager step takes its head size (``scored_tokens``, from the micro-batch's loss tokens) per call: the
    bucket's static inputs are made once, not again for each new count of loss tokens."""
    model, forward, plan, d = _setup()
    held = StepGraphs(capture=False)
    g = torch.Generator().manual_seed(3)
    heads = set()
    for _ in range(4):  # other loss masks: other loss-token counts per micro-batch, the same buckets
        d["loss_mask"] = (d["labels"] >= 0) & (torch.rand(d["labels"].shape, generator=g) < 0.7)
        counts = d["loss_mask"].sum(1).tolist()
        heads |= {sum(counts[i] for i in mb) for mb in plan.micro_batches[0]}
        _step(model, forward, plan, d, held, loss_tokens=counts)
    assert len(heads) > len(set(plan.buckets(0)))  # more head sizes than buckets
    assert len(held._entries) == len(set(plan.buckets(0))), (len(held._entries), plan.buckets(0))
    assert held.eager == 4 * plan.num_micro_batches


def test_buckets_true_with_a_forward_of_ones_own_warns_and_runs_the_plain_step():
    model, forward, plan, d = _setup()

    def mine(*args, **kw):  # a caller's wrapper: no plan= path to pad
        return forward(*args, **kw)

    plain, plain_grads = _step(model, forward, plan, d, False, buckets=False)
    with pytest.warns(UserWarning, match="not one make_forward made"):
        got, got_grads = _step(model, mine, plan, d, False, buckets=True)
    assert torch.equal(got.loss, plain.loss) and all(torch.equal(got_grads[n], plain_grads[n]) for n in plain_grads)


def test_padded_eager_steps_size_the_head_as_the_plain_step_does(cpu_graphs, monkeypatch):
    """The head's rows (``scored_tokens`` rounded to slots): a padded eager step keeps the plain step's rounding
    (``slots_for`` of its loss tokens), where a graph rounds up to a quarter of its bucket to bound the graphs; the
    outputs are the plain step's either way (thousands of tokens: below 64 the slots are the bucket's either way)."""
    from packfwd.forward import scored

    model, forward, plan, d = _setup(width=1024, max_tokens=3000)
    d["loss_mask"] = d["loss_mask"] & (torch.arange(1024)[None] >= 300)  # prompts: the head scores part of a bucket
    slots = []
    original = scored.slots_for
    monkeypatch.setattr(scored, "slots_for", lambda count, tokens: slots.append(original(count, tokens)) or slots[-1])
    plain, _ = _step(model, forward, plan, d, False)
    plain_slots, slots[:] = list(slots), []
    padded, _ = _step(model, forward, plan, d, StepGraphs(capture=False))
    padded_slots, slots[:] = list(slots), []
    graphed, _ = _step(model, forward, plan, d, StepGraphs())
    graphed_slots = slots[-plan.num_micro_batches:]
    counts = [int(d["loss_mask"][list(mb)].sum()) for mb in plan.micro_batches[0]]
    buckets = [t for _, t in plan.buckets(0)]
    assert plain_slots == [original(c, t) for c, t in zip(counts, plan.tokens[0])]
    assert padded_slots == [original(c, t) for c, t in zip(counts, buckets)]
    quarters = [min(t, -(-c // -(-t // 4)) * -(-t // 4)) for c, t in zip(counts, buckets)]
    assert graphed_slots == [original(q, t) for q, t in zip(quarters, buckets)]
    assert any(q > p for q, p in zip(quarters, padded_slots)), (quarters, padded_slots)
    for out in (padded, graphed):
        torch.testing.assert_close(out.loss, plain.loss, rtol=1e-12, atol=1e-14)


def test_an_moe_models_padded_step_equals_its_plain_step_and_routes_no_pad(monkeypatch):
    """The padded step of a Qwen3-MoE (float64, 2 MoE layers of 4 experts top-2): loss, outputs and every gradient
    equal the plain step's to rounding, and its experts get the real tokens only (``2 x 2 x`` real tokens per
    micro-batch, however many pads its bucket adds), read in the experts' forward (a hook would send the step to
    the plain path)."""
    import transformers
    from megatron.core.transformer.moe.experts import SequentialMLP

    from packfwd.models import from_hf

    from .test_moe import TINY, randomise

    hf = randomise(transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **TINY, intermediate_size=48, moe_intermediate_size=16, num_experts=4, norm_topk_prob=True,
        mlp_only_layers=[1], head_dim=16)))
    model = from_hf(hf, params_dtype=torch.float64)
    _, forward, plan, d = _setup()
    d["ids"] = d["ids"] % TINY["vocab_size"]
    d["labels"] = pf.next_token_labels(d["ids"], d["mask"])
    experts = {type(m) for m in model.modules() if isinstance(m, SequentialMLP)}
    routed = []
    for cls in experts:
        original = cls.forward
        monkeypatch.setattr(cls, "forward", lambda self, x, counts, probs, original=original: (
            routed.append(int(counts.sum())), original(self, x, counts, probs))[1])

    def step(buckets):
        model.zero_grad(set_to_none=True)
        routed.clear()
        out = run_micro_batches(forward, model, plan, d["ids"], d["mask"], dp_rank=0, buckets=buckets,
                                labels=d["labels"], loss_fn=lambda o: -o["log_probs"],
                                loss_mask=d["loss_mask"])
        return out, grads_of(model), list(routed)

    plain, plain_grads, plain_routed = step(False)
    padded, padded_grads, padded_routed = step(True)
    assert forward.padded_steps.reason is None and forward.padded_steps.eager == plan.num_micro_batches
    assert any(t > used for (_, t), used in zip(plan.buckets(0), plan.tokens[0])), "no bucket adds padding"
    per_layer = [2 * used for used in plan.tokens[0] for _ in range(2)]  # top-2, two MoE layers each
    assert plain_routed == padded_routed == per_layer, (plain_routed, padded_routed, per_layer)
    torch.testing.assert_close(padded.loss, plain.loss, rtol=1e-12, atol=1e-14)
    for k in plain.outputs:
        torch.testing.assert_close(padded.outputs[k], plain.outputs[k], rtol=1e-12, atol=1e-13)
    assert padded_grads.keys() == plain_grads.keys() and any("experts" in n for n in plain_grads)
    for n in plain_grads:
        torch.testing.assert_close(padded_grads[n], plain_grads[n], rtol=1e-10, atol=1e-13)


def grads_of(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
