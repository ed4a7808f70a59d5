"""Bad input fails at planning time with a ValueError/TypeError that names the argument and the fix."""

import pytest
import torch

from packfwd import (default_seq_align, from_bshd, from_thd, next_token_labels, plan_bshd, plan_thd, plan_unpad,
                     sp_pad, to_bshd, to_thd, unpad)

X = torch.randn(2, 5, 3)
MASK = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], dtype=torch.bool)


@pytest.mark.parametrize(
    "call, exc, words",
    [
        (lambda: to_thd(X, MASK[:, :4]), ValueError, "attention_mask has shape"),
        (lambda: to_thd(X, MASK[0]), ValueError, "must be 2-D"),
        (lambda: to_thd(X, MASK.float()), TypeError, "attention_mask.bool()"),
        (lambda: to_thd(X, MASK.long() * 2), ValueError, "other than 0 and 1"),
        (lambda: to_thd(X, MASK.long() - 1), ValueError, "other than 0 and 1"),
        (lambda: to_thd(X, MASK.tolist()), TypeError, "attention_mask must be a torch.Tensor"),
        (lambda: to_thd(X, MASK, tp_size=0), ValueError, "tp_size must be >= 1"),
        (lambda: to_thd(X, MASK, cp_size=0), ValueError, "cp_size must be >= 1"),
        (lambda: to_thd(X, MASK, tp_size=2.0), TypeError, "tp_size must be a Python int"),
        (lambda: to_thd(X, MASK, cp_size=2, cp_rank=2), ValueError, "cp_rank=2 is out of range"),
        (lambda: to_thd(X, MASK, cp_size=2, cp_rank=-1), ValueError, "cp_rank=-1 is out of range"),
        (lambda: to_thd(X, MASK, cp_size=2, cp_rank=0, seq_align=6), ValueError, "multiple of 4"),
        (lambda: to_thd(X, MASK, cp_size=2), ValueError, "cp_size=2 needs cp_rank"),
        (lambda: plan_thd(MASK, tp_size=2, cp_size=4), ValueError, r"pass cp_rank= .* 0 to 3"),
        (lambda: to_thd(X, MASK, seq_align=0), ValueError, "seq_align must be >= 1"),
        (lambda: to_thd(X, MASK, max_seqlen=2), ValueError, "max_seqlen=2 is below"),
        (lambda: to_thd(X, MASK, seqlens=[3, 5, 1]), ValueError, "seqlens has 3 entries"),
        (lambda: to_thd(X, plan_thd(MASK), tp_size=2), TypeError, "pass one or the other"),
        (lambda: to_thd(X, None), TypeError, "attention_mask is required"),
        # a plan with planning arguments beside it: they were ignored silently (to_thd refuses them)
        (lambda: to_bshd(X, plan_bshd(MASK), tp_size=4), TypeError, r"BshdInfo plan and .*tp_size=4.*one or the other"),
        (lambda: to_bshd(X, plan_bshd(MASK), seqlens=[3, 5]), TypeError, r"seqlens=\[3, 5\].*one or the other"),
        (lambda: unpad(X, plan_unpad(MASK), seqlens=[3, 4]), TypeError, "UnpadInfo plan and seqlens"),
        (lambda: unpad(X, MASK.to(torch.float16)), TypeError, "attention_mask has dtype"),
        (lambda: sp_pad(X, 0), ValueError, "tp_size must be >= 1"),
        # the alignment of no CP size: default_seq_align(0) and (-4) returned 1, (True) 1, (2.0) 4.0
        (lambda: default_seq_align(0), ValueError, "cp_size must be >= 1"),
        (lambda: default_seq_align(-4), ValueError, "cp_size must be >= 1"),
        (lambda: default_seq_align(2.0), TypeError, "cp_size must be a Python int"),
        (lambda: to_bshd(X, MASK, tp_size=-1), ValueError, "tp_size must be >= 1"),
        (lambda: next_token_labels(X[..., 0].long(), MASK[:1]), ValueError, "attention_mask has shape"),
    ],
)
def test_planning_errors(call, exc, words):
    with pytest.raises(exc, match=words):
        call()


@pytest.mark.parametrize("make_plan, apply", [
    (lambda: plan_thd(MASK), to_thd),
    (lambda: plan_unpad(MASK), unpad),
    (lambda: plan_bshd(MASK), to_bshd),
], ids=["thd", "unpad", "bshd"])
def test_applying_a_plan_checks_x_against_it(make_plan, apply):
    """A plan of a [2, 5] mask applied to x [5, 2, 3] (same element count, rows and columns swapped) or [2, 4, 3]:
    once reshaped silently (the wrong tokens, or torch's reshape error), now a ValueError naming x and the shape."""
    plan = make_plan()
    for x in (X.transpose(0, 1).contiguous(), X[:, :4], X.reshape(-1, 3)):
        with pytest.raises(ValueError, match=r"x has shape .* plan was made for \[b=2, s=5"):
            apply(x, plan)
    with pytest.raises(TypeError, match="nested"):
        apply(torch.nested.nested_tensor([X[0, :3], X[1]], layout=torch.jagged), plan)


def test_from_thd_checks_outputs_against_the_plan():
    infos = [plan_thd(MASK, cp_size=2, cp_rank=r) for r in range(2)]
    outs = [to_thd(X, i)[0] for i in infos]
    with pytest.raises(TypeError, match="list of all 2 CP ranks"):
        from_thd(outs[0], infos[0])
    with pytest.raises(ValueError, match="got 1 rank outputs"):
        from_thd(outs[:1], infos[0])
    with pytest.raises(ValueError, match="tokens but the plan has"):
        from_thd([outs[0][:-1], outs[1]], infos[0])
    one = plan_thd(MASK)
    with pytest.raises(ValueError, match="tokens but the plan has"):
        from_thd(torch.zeros(one.local_tokens + 1, 3), one)


def test_from_bshd_checks_shape():
    y, info = to_bshd(X, MASK)
    with pytest.raises(ValueError, match="the plan expects"):
        from_bshd(y[:, :-1], info)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a second device")
def test_devices_must_match():
    with pytest.raises(ValueError, match="move both to one device"):
        to_thd(X.cuda(), MASK)


def test_devices_must_match_meta():
    with pytest.raises(ValueError, match="move both to one device"):
        to_thd(X.to("meta"), MASK)


# ------------------------------------------------------------------------------------------ torch.compile


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_a_compiled_function_calling_the_forward_equals_eager(data_format):
    """Planning is a graph break (it used to fail: "'ndarray' object has no attribute 'clone'")."""
    from packfwd import make_forward
    from packfwd.logits import log_probs_and_entropy
    from packfwd.testing import OneHotModel

    model = OneHotModel(5)
    ids, mask = torch.tensor([[0, 3, 4, 1], [2, 1, 0, 0]]), torch.tensor([[0, 1, 1, 1], [1, 1, 0, 0]])
    forward = make_forward(data_format, logits_processor=log_probs_and_entropy)

    def loss(ids, mask, temperature):
        out = forward(model, ids, mask, labels=next_token_labels(ids, mask), temperature=temperature)
        return (out["log_probs"] * 2 + out["entropy"]).sum(-1)

    temperature = torch.tensor([0.5, 2.0])
    torch.testing.assert_close(torch.compile(loss, backend="eager")(ids, mask, temperature), loss(ids, mask, temperature))


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_a_compiled_function_calling_the_forward_of_a_megatron_model_equals_eager(data_format):
    """The same with packfwd's Megatron-Core model, whose forward breaks the graph again inside Megatron-Core: the
    forward must not hold a context manager open around the model call (dynamo could not resume it: "'ListVariable'
    object is not iterable")."""
    from packfwd import make_forward
    from packfwd.logits import log_probs_and_entropy
    from packfwd.models import ModelArgs, build_model

    torch.manual_seed(0)
    model = build_model(ModelArgs(vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=1,
                                  num_attention_heads=2))
    ids, mask = torch.randint(0, 32, (2, 6)), torch.tensor([[0, 1, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]]).bool()
    forward = make_forward(data_format, logits_processor=log_probs_and_entropy)

    def loss(ids, mask):
        return forward(model, ids, mask, labels=next_token_labels(ids, mask))["log_probs"].sum(-1)

    torch.testing.assert_close(torch.compile(loss, backend="eager")(ids, mask), loss(ids, mask))


def test_fullgraph_planning_names_the_way_to_compile():
    """``to_thd(x, mask)`` plans on the host; under fullgraph=True it raises saying how to compile (torch >= 2.11:
    older ones take no message for a graph break, and raise dynamo's own words)."""
    words = r"plan outside the compiled function \(info = plan_thd\(mask\).*to_thd\(x, info\)"
    with pytest.raises(Exception, match=words if torch.__version__ >= (2, 11) else None):
        torch.compile(lambda x, mask: to_thd(x, mask)[0], fullgraph=True, backend="eager")(X, MASK)
