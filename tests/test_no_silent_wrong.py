"""No silent wrong numbers: every call that used to return a plausible-looking wrong tensor now returns the right
one or raises an error that names the fix.

Each test below failed on the code before this suite was written (the hazard is named in its docstring).  The
references are HF transformers run on each sequence alone (``test_hf_interop.per_sequence``) or the
single-process model, never packfwd's own output under another setting.
"""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, LlamaForTokenClassification

from packfwd import make_forward, next_token_labels, plan_thd
from packfwd.logits import log_probs, log_probs_and_entropy, vocab_parallel
from packfwd.models import ModelArgs, build_model, from_hf

from .test_hf_interop import TINY, randomise, ragged_batch

FORMATS = ["thd", "bshd"]


@functools.lru_cache(maxsize=None)
def _llama():
    hf = randomise(LlamaForCausalLM(LlamaConfig(**TINY, num_key_value_heads=2)))
    return hf, from_hf(hf)


# ------------------------------------------------------------------------------------------ empty batches


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("shape", [(0, 5), (3, 0), (3, 4)], ids=["b=0", "s=0", "all-padding"])
def test_empty_batch_gives_zeros_and_zero_gradients(data_format, shape):
    """Hazard: Megatron's attention crashed with a reshape error on a batch without a real token."""
    _, model = _llama()
    ids = torch.randint(0, 128, shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    logits = make_forward(data_format)(model, ids, mask)
    assert logits.shape == (*shape, 128) and not logits.any()
    out = make_forward(data_format, logits_processor=log_probs_and_entropy)(
        model, ids, mask, labels=next_token_labels(ids, mask)
    )
    assert out["log_probs"].shape == shape and out["entropy"].shape == shape
    model.zero_grad(set_to_none=True)
    (out["log_probs"].sum() + logits.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and not g.any() for g in grads)


# ------------------------------------------------------------------------------------------ value models


def test_value_model_refuses_a_token_processor():
    """Hazard: labels indexed a [t, 1] value head and gave zeros."""
    args = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1, num_attention_heads=2,
                     value_head=True)
    model = build_model(args)
    ids, mask = torch.randint(0, 64, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    assert make_forward("thd")(model, ids, mask).shape == (2, 5)
    with pytest.raises(ValueError, match=r"value head: its output is \[b, s\]"):
        make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask, labels=ids)


# ------------------------------------------------------------------------------------------ labels


@pytest.mark.parametrize("fn", [log_probs, log_probs_and_entropy])
def test_labels_outside_the_vocabulary_raise(fn):
    """Hazard: a label >= v gave garbage, including positive log-probs."""
    logits = torch.randn(3, 8)
    with pytest.raises(ValueError, match=r"token id >= the vocabulary size 8"):
        fn(logits, torch.tensor([1, 8, -100]))
    assert fn(logits, torch.tensor([1, 7, -100])) is not None  # the last id and the ignore index are fine


def test_labels_outside_the_vocabulary_raise_through_the_forward():
    _, model = _llama()
    ids, mask = ragged_batch("right")
    labels = next_token_labels(ids, mask)
    labels[0, 0] = 128
    with pytest.raises(ValueError, match="vocabulary size 128"):
        make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask, labels=labels)


# ------------------------------------------------------------------------------------------ clear errors


@pytest.mark.parametrize(
    "ids, error, match",
    [
        (torch.randint(0, 128, (2, 5, 1)), ValueError, r"input_ids.squeeze\(-1\)"),
        (torch.ones(2, 5, dtype=torch.bool), TypeError, "integer token ids"),
        (torch.ones(2, 5), TypeError, "integer token ids"),
        (torch.ones(2, 5, dtype=torch.uint8), TypeError, r"dtype torch.uint8.*input_ids.long\(\)"),
        (torch.ones(2, 5, dtype=torch.int8), TypeError, r"dtype torch.int8.*input_ids.long\(\)"),
        (torch.ones(2, 5, dtype=torch.int16), TypeError, r"dtype torch.int16.*input_ids.long\(\)"),
    ],
    ids=["[b,s,1]", "bool", "float", "uint8", "int8", "int16"],
)
@pytest.mark.parametrize("data_format", FORMATS)
def test_bad_ids_are_named(data_format, ids, error, match):
    _, model = _llama()
    with pytest.raises(error, match=match):
        make_forward(data_format)(model, ids, torch.ones(2, 5, dtype=torch.bool))


def test_int32_ids_give_the_int64_numbers():
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    with torch.no_grad():
        torch.testing.assert_close(make_forward("thd")(model, ids.int(), mask), make_forward("thd")(model, ids, mask))


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("bad, span", [(200, r", 200\]"), (-1, r"\[-1, ")], ids=[">=vocab", "negative"])
def test_ids_outside_the_vocabulary_are_named_before_the_model_runs(data_format, bad, span):
    """Hazard: torch's embedding raised an IndexError (on CUDA a device assert that kills the process); padding
    positions may still hold anything (they never reach the model)."""
    _, model = _llama()
    ids, mask = ragged_batch("right")
    ids[~mask] = 1000  # never read
    ids[1, 1] = bad
    with pytest.raises(ValueError, match=span + r".* at real tokens.*vocab_size=128"):
        make_forward(data_format)(model, ids, mask)
    with pytest.raises(ValueError, match="vocab_size=128"):  # jagged ids: every value is a real token
        make_forward(data_format)(model, torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)],
                                                                   layout=torch.jagged), None)
    ids[1, 1] = 5
    assert make_forward(data_format)(model, ids, mask).shape == (*ids.shape, 128)


@pytest.mark.parametrize("processor", [None, log_probs_and_entropy], ids=["no-processor", "processor"])
def test_mtp_loss_mask_without_mtp_names_the_fix(processor):
    """Hazard: a TypeError from inside the processor (unexpected keyword), or a list of 'processor arguments'."""
    _, model = _llama()
    ids, mask = ragged_batch("right")
    forward = make_forward("thd", logits_processor=processor)
    with pytest.raises(TypeError, match=r"mtp_loss_mask.*make_forward\(\.\.\., mtp=True\)"):
        forward(model, ids, mask, mtp_loss_mask=mask, **({"labels": ids} if processor else {}))


def test_seq_align_is_refused_by_bshd():
    """Hazard: make_forward('bshd', seq_align=...) accepted the argument and ignored it."""
    with pytest.raises(ValueError, match="seq_align=8 only applies to data_format='thd'"):
        make_forward("bshd", seq_align=8)


def test_a_huge_seq_align_is_refused_before_allocating():
    """Hazard: a seq_align of 2**30 planned a layout of terabytes."""
    with pytest.raises(ValueError, match="seq_align=1073741824"):
        plan_thd(torch.ones(4, 3, dtype=torch.bool), seq_align=2**30)


def test_a_processor_returning_the_wrong_token_count_is_blamed():
    """Hazard: the error blamed the model output."""
    _, model = _llama()
    ids, mask = ragged_batch("right")

    def drops_one(logits):
        return {"x": logits[1:, 0]}

    for data_format in FORMATS:
        with pytest.raises(ValueError, match=r"logits_processor returned 'x' with shape .*one row per token"):
            make_forward(data_format, logits_processor=drops_one)(model, ids, mask)


@pytest.mark.parametrize("data_format", FORMATS)
def test_bad_position_ids_are_named(data_format):
    _, model = _llama()
    ids, mask = ragged_batch("right")
    with pytest.raises(ValueError, match=r"position_ids has shape \(4, 11\)"):
        make_forward(data_format)(model, ids, mask, position_ids=torch.zeros(4, 11, dtype=torch.long))
    with pytest.raises(TypeError, match="integer positions"):
        make_forward(data_format)(model, ids, mask, position_ids=torch.zeros(4, 12))


# ------------------------------------------------------------------------------------------ tensor parallelism


class _ShardedToy(torch.nn.Module):
    """A model whose output layer claims a vocabulary split over two ranks (no process group needed to plan)."""

    def __init__(self):
        super().__init__()
        self.config = SimpleNamespace(tensor_model_parallel_size=2, context_parallel_size=1, sequence_parallel=False,
                                      hidden_size=4, params_dtype=torch.float32)
        self.vocab_size = 8
        self.output_layer = SimpleNamespace(tp_group="the-tp-group")
        self.weight = torch.nn.Parameter(torch.zeros(1))

    def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
        return torch.zeros(*input_ids.shape, 4) + self.weight


def test_an_unmarked_processor_is_refused_on_a_vocab_parallel_model():
    """Hazard: each rank normalised its own half of the vocabulary: log-probs off by 6-7 nats, no warning."""

    def my_log_probs(logits, labels):
        return {"lp": torch.log_softmax(logits, -1).gather(-1, labels[:, None])[:, 0]}

    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(ValueError, match="split over 2 tensor-parallel ranks.*my_log_probs"):
        make_forward("thd", logits_processor=my_log_probs)(_ShardedToy(), ids, ids > 0, labels=ids)


def test_packfwd_processors_get_the_model_tp_group():
    seen = {}

    @vocab_parallel
    def spy(logits, *, tp_group=None):
        seen["group"] = tp_group
        return {"x": logits[:, 0]}

    ids = torch.tensor([[1, 2, 3]])
    make_forward("thd", logits_processor=spy)(_ShardedToy(), ids, ids > 0)
    assert seen["group"] == "the-tp-group"


def _tp_rank(rank, world_size, hf):
    """Rank side of the TP test: the documented forward on a TP=2 shard, processor unbound."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=2)
    model = from_hf(hf, tp_size=2, tp_rank=ps.get_tensor_model_parallel_rank())
    ids, mask = ragged_batch("mixed")
    out = make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask,
                                                                       labels=next_token_labels(ids, mask))
    ps.destroy_model_parallel()
    return {k: v.detach() for k, v in out.items()}


def test_tensor_parallel_log_probs_are_full_vocabulary():
    """The documented ``make_forward('thd', logits_processor=log_probs_and_entropy)`` (docs/models.md) on a TP=2 model: each rank's
    log-probs and entropy equal the single-process model's (fp32, atol 2e-5)."""
    from packfwd.testing import run_local

    hf, model = _llama()
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    ref = make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask, labels=labels)
    for out in run_local(_tp_rank, 2, hf, backend="gloo"):
        for key in ("log_probs", "entropy"):
            torch.testing.assert_close(out[key], ref[key].detach(), atol=2e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------ positions and masks


def _hf_with_positions(hf, ids, mask, positions):
    """HF transformers on each sequence alone, RoPE from the given positions of its real tokens."""
    with torch.no_grad():
        return [hf(ids[i][mask[i]][None], position_ids=positions[i][mask[i]][None]).logits[0]
                for i in range(ids.shape[0])]


@pytest.mark.parametrize("data_format", FORMATS)
@pytest.mark.parametrize("padding", ["right", "mixed"])
def test_caller_position_ids_are_honoured(data_format, padding):
    """Hazard: zeros or arbitrary positions gave logits bit-identical to passing none (HF's change by 2.5)."""
    hf, model = _llama()
    ids, mask = ragged_batch(padding)
    g = torch.Generator().manual_seed(3)
    # RoPE is relative: a constant shift per row changes nothing, so stretch the distances as well
    positions = 2 * (mask.cumsum(1) - 1).clamp(min=0) + torch.randint(0, 50, (ids.shape[0], 1), generator=g)
    forward = make_forward(data_format)
    with torch.no_grad():
        got = forward(model, ids, mask, position_ids=positions)
        default = forward(model, ids, mask)
        zeros = forward(model, ids, mask, position_ids=torch.zeros_like(ids))
    for i, want in enumerate(_hf_with_positions(hf, ids, mask, positions)):
        torch.testing.assert_close(got[i][mask[i]], want, atol=2e-5, rtol=1e-4)
    assert (zeros - default)[mask].abs().max() > 0.1 and (got - default)[mask].abs().max() > 0.1
    natural = (mask.cumsum(1) - 1).clamp(min=0)  # the default, given explicitly: the same numbers
    with torch.no_grad():
        torch.testing.assert_close(forward(model, ids, mask, position_ids=natural)[mask], default[mask],
                                   atol=1e-6, rtol=0)


@pytest.mark.parametrize("padding", ["right", "left", "mixed"])
def test_the_model_takes_a_bshd_padding_mask(padding):
    """verl's BSHD calls hand the model ``attention_mask [b, s]`` (True at real tokens) with any padding; the
    model's real-token logits must equal HF on each sequence alone, with the caller's positions."""
    hf, model = _llama()
    ids, mask = ragged_batch(padding)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    with torch.no_grad():
        got = model(input_ids=ids, position_ids=positions, attention_mask=mask)
    assert got.shape == (*ids.shape, 128) and not got[~mask].any()
    for i, want in enumerate(_hf_with_positions(hf, ids, mask, positions)):
        torch.testing.assert_close(got[i][mask[i]], want, atol=2e-5, rtol=1e-4)


def test_multimodal_positions_on_a_text_model_are_refused():
    _, model = _llama()
    ids, mask = ragged_batch("right")
    with pytest.raises(ValueError, match="1-D RoPE"):
        make_forward("thd")(model, ids, mask, position_ids=torch.zeros(3, *ids.shape, dtype=torch.long))


def test_from_hf_of_the_bare_decoder_names_the_fix():
    """Hazard: ``from_hf(hf.model)`` failed with ``KeyError: 'model.embed_tokens.weight'``."""
    hf, _ = _llama()
    with pytest.raises(ValueError, match=r"from_hf\(hf\) for a LlamaForCausalLM rather than from_hf\(hf.model\)"):
        from_hf(hf.model)


def test_megatron_rope_model_refuses_positions_it_cannot_use():
    """A model built with ``packed_rope=False`` (Megatron-Core's own THD RoPE) reads no positions: the default
    ones pass, others raise instead of being ignored."""
    from packfwd.models.convert.hf import args_from_hf_config

    hf, _ = _llama()
    model = build_model(args_from_hf_config(hf.config), packed_rope=False)
    ids, mask = ragged_batch("right")
    make_forward("thd")(model, ids, mask)  # default positions: fine
    with pytest.raises(ValueError, match="packed_rope=False"):
        make_forward("thd")(model, ids, mask, position_ids=2 * (mask.cumsum(1) - 1).clamp(min=0))


def test_a_cp_group_or_rank_that_is_not_the_models_is_refused():
    """Hazard: a forgotten or wrong CP group/rank packs one rank's share and gathers another's outputs."""
    from packfwd.testing import run_local

    errors = run_local(_wrong_cp_rank, 2, backend="gloo")
    assert all("cp_rank=" in e and "this process is its rank" in e for e in errors), errors


def _wrong_cp_rank(rank, world_size):
    import torch.distributed as dist

    ids, mask = ragged_batch("right")
    forward = make_forward("thd", cp_size=2, cp_rank=1 - rank, cp_group=dist.group.WORLD)
    try:
        forward(torch.nn.Identity(), ids, mask)
    except ValueError as exc:
        return str(exc)
    return "no error"


def test_the_model_takes_an_all_padding_bshd_mask():
    """The model's own BSHD mask path with no real token: zeros, not Megatron's reshape error."""
    _, model = _llama()
    ids, mask = torch.randint(1, 128, (2, 5)), torch.zeros(2, 5, dtype=torch.bool)
    out = model(input_ids=ids, position_ids=None, attention_mask=mask)
    assert out.shape == (2, 5, 128) and not out.any()


# ------------------------------------------------------------------------------------------ tensor temperature

# layouts with padding slots (BSHD's short rows, THD's alignment), where a packed temperature holds the fill 0
LAYOUTS = {"thd": {}, "thd-aligned": dict(seq_align=8), "bshd": {}}
BAD_TEMPERATURES = {"zero": 0.0, "negative": -0.5, "nan": float("nan"), "inf": float("inf")}


def _layout_forward(layout: str, head: str):
    fmt = layout.split("-")[0]
    return make_forward(fmt, logits_processor=log_probs_and_entropy, head=head, **LAYOUTS[layout])


@pytest.mark.parametrize("head", ["logits", "fused"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("bad, shape", [("zero", "[b]"), ("negative", "[b,s]"), ("nan", "[b,s]"), ("inf", "[b]")])
def test_a_bad_tensor_temperature_at_a_real_token_raises(head, layout, shape, bad):
    """Hazard: a tensor temperature of 0, < 0, NaN or inf at a real token was read as 1.0 (only the scalar form
    raised), giving the log-probs of another temperature."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    temperature = torch.tensor([0.7, 1.3, 1.0, 2.0])
    if shape == "[b,s]":
        temperature = temperature[:, None].expand(ids.shape).clone()
        temperature[2, mask[2].nonzero()[1, 0]] = BAD_TEMPERATURES[bad]  # one real token of row 2
    else:
        temperature[2] = BAD_TEMPERATURES[bad]
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        _layout_forward(layout, head)(model, ids, mask, labels=next_token_labels(ids, mask), temperature=temperature)


@pytest.mark.parametrize("data_format", FORMATS)
def test_multimodal_positions_for_a_text_model_are_refused_in_the_callers_shape(data_format):
    """``[3, b, s]`` positions given to a 1-D RoPE model: refused before packing, naming the caller's shape (the
    model's own check saw the packed ``(3, 1, t)``)."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    with pytest.raises(ValueError, match=rf"position_ids has shape \(3, {ids.shape[0]}, {ids.shape[1]}\); this model "
                                         "uses 1-D RoPE"):
        make_forward(data_format, logits_processor=log_probs_and_entropy)(
            model, ids, mask, labels=next_token_labels(ids, mask),
            position_ids=torch.zeros(3, *ids.shape, dtype=torch.long))


def test_a_temperature_of_another_shape_is_named():
    """A ``[b, s, 1]`` temperature was refused under another argument's name (``real_tokens``, made from it)."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    for shape in ((*ids.shape, 1), (ids.shape[0], 1)):  # [b, s, 1], and [b, 1] (not a per-token [b, s, ...])
        with pytest.raises(ValueError, match=rf"temperature has shape \({shape[0]}, \d+(, 1)?\); pass a number, a "
                                             r"tensor \[b\]"):
            _layout_forward("thd", "logits")(model, ids, mask, labels=next_token_labels(ids, mask),
                                             temperature=torch.ones(*shape))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_bad_temperature_is_named_by_its_row_and_column(layout):
    """A bad CPU temperature was named by its place among the packed tokens, which the caller never sees.  Now the
    forward names its row and column in the batch (its row, for a per-sequence value)."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    forward = _layout_forward(layout, "logits")
    row = 2
    col = int(mask[row].nonzero()[0])  # the row's first real token (scored: its label is the next token)
    per_token = torch.ones(ids.shape)
    per_token[row, col] = float("nan")
    with pytest.raises(ValueError, match=rf"temperature is nan at row {row}, column {col} of the batch"):
        forward(model, ids, mask, labels=labels, temperature=per_token)
    per_sequence = torch.tensor([1.0, 1.0, -0.5, 1.0])
    with pytest.raises(ValueError, match=r"temperature is -0.5 at row 2 \(a per-sequence value\)"):
        forward(model, ids, mask, labels=labels, temperature=per_sequence)
    # what the logits' own check accepts is accepted here too: padding, the last real token (its label ignored)
    per_token[row, col] = 1.0
    per_token[~mask] = 0.0
    per_token[row, int(mask[row].nonzero()[-1])] = 0.0
    with torch.no_grad():
        forward(model, ids, mask, labels=labels, temperature=per_token)


def test_a_bad_temperature_is_refused_alike_on_every_path_and_named_by_the_batchs_row():
    """The tokens a bad temperature may sit at were not the same on every path: a token whose label is ignored was
    accepted by a plain call and refused with seqlens= (every row computed, the outputs masked), by its packed
    index; run_micro_batches named the row inside its micro-batch.  Now every scoring path accepts it, a forward
    that scores every token (scored_only=False) refuses it by row and column, and run_micro_batches names the
    batch's row."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    forward = _layout_forward("thd", "logits")
    lengths = mask.sum(1).tolist()
    unscored = torch.ones(ids.shape)
    row = 1
    unscored[row, int(mask[row].nonzero()[-1])] = 0.0  # the row's last real token: its label is ignored
    with torch.no_grad():
        plain = forward(model, ids, mask, labels=labels, temperature=unscored)
        masked = forward(model, ids, mask, labels=labels, temperature=unscored, seqlens=lengths)
    for key in plain:
        torch.testing.assert_close(masked[key], plain[key])
    every = make_forward("thd", logits_processor=log_probs_and_entropy, scored_only=False)
    col = int(mask[row].nonzero()[-1])
    with pytest.raises(ValueError, match=rf"temperature is 0.0 at row {row}, column {col} of the batch.*"
                                         "scored_only=False scores every other real token"):
        every(model, ids, mask, labels=labels, temperature=unscored)
    plan = plan_micro_batches(lengths, max_tokens=max(lengths) + 1)  # micro-batches of one or two sequences
    assert any(3 in mb and mb.index(3) != 3 for mb in plan.micro_batches[0])
    bad = torch.ones(ids.shape)
    bad[3, int(mask[3].nonzero()[0])] = float("nan")
    with pytest.raises(ValueError, match=rf"temperature is nan at row 3, column {int(mask[3].nonzero()[0])} of the"):
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels, temperature=bad)
    with torch.no_grad():
        run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels, temperature=unscored)


def test_the_temperature_check_follows_packfwds_processors_only_and_reads_plans_and_per_sequence_masks():
    """A processor of the caller's own may read a temperature by its own rule (0 as greedy): the forward does not
    refuse it for packfwd.logits' rule.  A plan= call names the row and column from the plan's mask; a [b]
    loss_mask counts for each token of its sequence."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    bad = torch.ones(ids.shape)
    col = int(mask[1].nonzero()[0])
    bad[1, col] = 0.0

    def greedy_at_zero(logits, labels, temperature):  # its own rule: 0 means the argmax
        t = torch.where(temperature > 0, temperature, 1.0)[:, None]
        return {"log_probs": torch.log_softmax(logits / t, -1).gather(-1, labels.clamp(min=0)[:, None])[:, 0]}

    with torch.no_grad():
        make_forward("thd", logits_processor=greedy_at_zero)(model, ids, mask, labels=labels, temperature=bad)
        forward = _layout_forward("thd", "logits")
        plan = forward.plan(ids, mask)
        with pytest.raises(ValueError, match=rf"temperature is 0.0 at row 1, column {col} of the batch"):
            forward(model, ids, plan=plan, labels=labels, temperature=bad)
        per_sequence = torch.tensor([True, False, True, True])  # row 1 not scored: its temperatures not read
        forward(model, ids, mask, labels=labels, temperature=bad, loss_mask=per_sequence)
        with pytest.raises(ValueError, match=rf"temperature is 0.0 at row 1, column {col} of the batch"):
            forward(model, ids, mask, labels=labels, temperature=bad, loss_mask=~per_sequence)


@pytest.mark.parametrize("head", ["logits", "fused"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_temperature_at_padding_may_hold_anything(head, layout):
    """Padding positions of a [b, s] temperature, the entry of a row without real tokens, and the layout's own
    padding slots (the fill 0) are never checked and change no number; nor are tokens token_mask leaves out."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    mask[1] = False  # a row without a real token: its per-sequence temperature is never used
    labels = next_token_labels(ids, mask)
    forward = _layout_forward(layout, head)
    good = torch.tensor([0.7, 1.3, 1.0, 2.0])
    with torch.no_grad():
        want = forward(model, ids, mask, labels=labels, temperature=good)
        per_sequence = forward(model, ids, mask, labels=labels, temperature=torch.tensor([0.7, 0.0, 1.0, 2.0]))
        noisy = good[:, None].expand(ids.shape).clone()
        noisy[~mask] = torch.tensor([0.0, -1.0, float("nan")]).repeat(int((~mask).sum()))[: int((~mask).sum())]
        per_token = forward(model, ids, mask, labels=labels, temperature=noisy)
        response = mask & (mask.cumsum(1) > 3)
        left_out = noisy.masked_fill(mask & ~response, 0.0)  # bad only where token_mask leaves tokens out
        masked = forward(model, ids, mask, labels=labels, temperature=left_out, token_mask=response)
    for got in (per_sequence, per_token):
        for key in want:
            torch.testing.assert_close(got[key], want[key], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(masked["log_probs"], want["log_probs"] * response, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("fn", ["log_probs", "entropy", "log_probs_and_entropy", "fused"])
@pytest.mark.parametrize("bad", list(BAD_TEMPERATURES))
def test_the_logits_functions_refuse_a_bad_temperature(fn, bad):
    """Hazard: the functions read such entries as 1.0.  Now: a ValueError naming the value and the token, unless
    the token is left out by token_mask or marked as a layout's padding slot (real_tokens False); a 0-d tensor
    is checked like a float."""
    from packfwd.logits import entropy, fused_log_probs_and_entropy

    g = torch.Generator().manual_seed(0)
    hidden, weight = torch.randn(6, 8, generator=g), torch.randn(16, 8, generator=g)
    labels = torch.randint(0, 16, (6,), generator=g)
    call = {
        "log_probs": lambda **kw: {"log_probs": log_probs(hidden @ weight.T, labels, **kw)},
        "entropy": lambda **kw: {"entropy": entropy(hidden @ weight.T, **kw)},
        "log_probs_and_entropy": lambda **kw: log_probs_and_entropy(hidden @ weight.T, labels, **kw),
        "fused": lambda **kw: fused_log_probs_and_entropy(hidden, weight, labels, **kw),
    }[fn]
    temperature = torch.tensor([0.5, 1.0, 2.0, 1.5, 0.8, 1.2])
    temperature[3] = BAD_TEMPERATURES[bad]
    with pytest.raises(ValueError, match=rf"temperature is {bad if bad in ('nan', 'inf') else ''}.* at token 3"):
        call(temperature=temperature)
    with pytest.raises(ValueError, match="at the scalar tensor"):
        call(temperature=torch.tensor(BAD_TEMPERATURES[bad]))
    others = torch.arange(6) != 3
    want = call(temperature=temperature.masked_fill(~others, 1.0))
    for kw in (dict(token_mask=others), dict(real_tokens=others)):
        got = call(temperature=temperature, **kw)
        for key in want:
            assert torch.isfinite(got[key]).all()
            torch.testing.assert_close(got[key][others], want[key][others])


# ------------------------------------------------------------------------------------------ the loss tokens


def _step_batch():
    from packfwd.micro import plan_micro_batches

    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    return ids, mask, labels, plan_micro_batches(mask.sum(-1).tolist(), max_tokens=16)


@pytest.mark.parametrize("normalize", ["token_mean", "sequence_mean"])
def test_the_mean_counts_only_the_tokens_that_have_a_label(normalize):
    """Hazard: without a loss_mask the mean divided by every real token, each sequence's last one too, whose label
    is ignored (its log-prob is 0): a token mean 12 % too small on this batch.  Reference: the transformers model on
    each sequence alone, its next-token log-probs averaged by a plain loop."""
    from packfwd.micro import run_micro_batches

    hf, model = _llama()
    ids, mask, labels, plan = _step_batch()
    forward = make_forward("thd", logits_processor=log_probs_and_entropy)
    res = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels,
                            loss_fn=lambda o: -o["log_probs"], normalize=normalize)
    per_seq = []
    for logits, row in zip(per_sequence_logits(hf, ids, mask), range(ids.shape[0])):
        tokens = ids[row][mask[row]]
        lp = torch.log_softmax(logits[:-1].double(), -1).gather(-1, tokens[1:, None])[:, 0]
        per_seq.append(-lp)
    if normalize == "token_mean":
        want = torch.cat(per_seq).sum() / sum(len(x) for x in per_seq)
    else:
        want = torch.stack([x.mean() for x in per_seq]).mean()
    torch.testing.assert_close(res.loss.double(), want, rtol=1e-5, atol=1e-6)
    # the same through an explicit loss mask of the labelled tokens, and with their counts as host ints
    scored = mask & (labels >= 0)
    again = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels, loss_mask=scored,
                              loss_tokens=scored.sum(-1).tolist(), loss_fn=lambda o: -o["log_probs"],
                              normalize=normalize)
    torch.testing.assert_close(again.loss.double(), want, rtol=1e-5, atol=1e-6)


def per_sequence_logits(hf, ids, mask):
    with torch.no_grad():
        return [hf(ids[i][mask[i]][None]).logits[0] for i in range(ids.shape[0])]


def test_a_loss_mask_of_unlabelled_or_padding_tokens_is_refused_by_row_and_column():
    """Hazard: a response mask not shifted to the next-token labels (verl's response_mask as it is) marks each
    sequence's last token, whose label is ignored: its 0 loss counted in the mean, the first response token's
    prediction was left out, and nothing said so.  A mask over padding counted padding in the mean."""
    from packfwd.micro import run_micro_batches

    _, model = _llama()
    ids, mask, labels, plan = _step_batch()
    forward = make_forward("thd", logits_processor=log_probs_and_entropy)
    run = functools.partial(run_micro_batches, forward, model, plan, ids, mask, dp_rank=0, labels=labels,
                            loss_fn=lambda o: -o["log_probs"])
    with pytest.raises(ValueError, match=r"marks 4 token\(s\) .* row 0, column 11 has its label ignored .*shifting it "
                                         r"left by one"):
        run(loss_mask=mask.clone())  # every real token: the last ones have no label
    pad = int((~mask[1]).nonzero()[0, 0])
    bad = mask & (labels >= 0)
    bad[1, pad] = True
    with pytest.raises(ValueError, match=rf"row 1, column {pad} is padding"):
        run(loss_mask=bad)
    good = mask & (labels >= 0)
    with pytest.raises(ValueError, match=r"loss_tokens\[2\]=99 but the loss mask marks"):
        run(loss_mask=good, loss_tokens=[*good.sum(-1).tolist()[:2], 99, good.sum(-1).tolist()[3]])
    with pytest.raises(TypeError, match="one per sequence"):
        run(loss_mask=good, loss_tokens=int(good.sum()))
    with pytest.raises(ValueError, match="not the batch's total"):
        run(loss_mask=good, loss_tokens=[int(good.sum())])
    counts = good.sum(-1)
    want = run(loss_mask=good, loss_tokens=counts.tolist()).loss
    for host in (counts, counts.numpy()):  # a CPU tensor or a numpy array are host ints too
        assert torch.equal(run(loss_mask=good, loss_tokens=host).loss, want)
    with pytest.raises(TypeError, match="a meta tensor"):  # (a CUDA tensor alike: reading it would sync)
        run(loss_mask=good, loss_tokens=counts.to("meta"))
    with pytest.raises(ValueError, match=r"loss_tokens\[0\]=2.5; .* an int >= 0"):
        run(loss_mask=good, loss_tokens=[2.5, *counts.tolist()[1:]])
    with torch.no_grad():  # forward only: the mask only picks the tokens scored, more than needed is harmless
        out = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels, loss_mask=mask)
    assert out.outputs["log_probs"].shape == ids.shape
    value = from_hf(randomise(LlamaForTokenClassification(LlamaConfig(**TINY, num_labels=1))))
    with pytest.raises(ValueError, match=r"row 1, column 0 is padding .* pass loss_mask & attention_mask$"):
        run_micro_batches(make_forward("thd"), value, plan, ids, mask, dp_rank=0,
                          loss_fn=lambda v: v.float() ** 2, loss_mask=torch.ones_like(mask))
    n = mask.sum(-1).tolist()  # without labels every real token is a loss token: the counts must be the lengths
    with pytest.raises(ValueError, match=r"loss_tokens\[0\]=1 but sequence 0 has"):
        run_micro_batches(make_forward("thd"), model, plan, ids, mask, dp_rank=0, loss_tokens=[1, *n[1:]],
                          loss_fn=lambda o: o.float().logsumexp(-1))


@pytest.mark.parametrize("data_format", FORMATS)
def test_labels_per_sequence_or_missing_are_refused(data_format):
    """Hazard: labels of shape [b] were taken as one label per sequence and scored at every token (a [b] tensor is
    a per-sequence value for other arguments); labels left out failed inside the processor, after the model ran,
    with a bare "missing 1 required positional argument"."""
    _, model = _llama()
    ids, mask = ragged_batch("mixed")
    forward = make_forward(data_format, logits_processor=log_probs_and_entropy)
    with pytest.raises(ValueError, match=r"labels has shape \(4,\): labels are per token, never per sequence"):
        forward(model, ids, mask, labels=torch.tensor([5, 6, 7, 8]))
    with pytest.raises(ValueError, match=r"labels has shape \(4, 11\); pass \[b, s\] .*next_token_labels"):
        forward(model, ids, mask, labels=next_token_labels(ids, mask)[:, :-1])
    with pytest.raises(TypeError, match=r"'log_probs_and_entropy' needs labels=: .*next_token_labels"):
        forward(model, ids, mask)
    from packfwd.engine.checks import _required

    bound = functools.partial(log_probs, labels=next_token_labels(ids, mask).flatten())  # bound: not asked for
    assert "labels" not in _required(bound)

    @functools.wraps(log_probs)
    def wrapper(logits, **kw):  # a wrapper that fills labels itself is not asked for them (its own signature)
        return {"lp": log_probs(logits, torch.zeros(logits.shape[0], dtype=torch.long), **kw)}

    assert _required(wrapper) == ()

    import dataclasses

    @dataclasses.dataclass
    class Proc:  # eq=True: unhashable, and a processor all the same
        scale: float = 1.0

        def __call__(self, logits, labels):
            return log_probs_and_entropy(logits, labels)

    out = make_forward(data_format, logits_processor=Proc())(model, ids, mask, labels=next_token_labels(ids, mask))
    assert out["log_probs"].shape == ids.shape
    with pytest.raises(TypeError, match="'Proc' needs labels="):
        make_forward(data_format, logits_processor=Proc())(model, ids, mask)
