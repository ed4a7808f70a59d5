"""Helpers of test_verl_dropin.py: the batch, the models, verl-style logits processors, the views that let
verl's forwards call packfwd's model as they call a TE-backed GPTModel, the comparison of outputs and gradients,
stand-in models, and the work of each rank of the TP=2 / CP=2 worlds."""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch

import packfwd.verl as pv
from packfwd import next_token_labels
from packfwd.models import ModelArgs, build_model

from .verl_forward_ref import load_verl_forward

vf = load_verl_forward()

ARGS = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                 num_query_groups=2)
OUT_TOL = dict(atol=1e-5, rtol=1e-5)
GRAD_TOL = dict(atol=1e-5, rtol=1e-4)


# ------------------------------------------------------------------------------------------- data and models


def batch():
    """verl's padded layout ``[b, 11]``: prompts left-padded to 5, responses right-padded to 6; the ids, mask,
    positions, next-token labels (0 where none), their mask and a per-row temperature, all ``[b, 11]``."""
    g = torch.Generator().manual_seed(0)
    prompts, responses = [4, 2, 5, 1], [3, 6, 1, 4]
    mask = torch.zeros(4, 11, dtype=torch.bool)
    for i, (p, r) in enumerate(zip(prompts, responses)):
        mask[i, 5 - p : 5 + r] = True
    ids = torch.randint(1, ARGS.vocab_size, mask.shape, generator=g).masked_fill(~mask, 0)
    positions = (mask.cumsum(1) - 1).clamp(min=0)
    labels = next_token_labels(ids, mask, ignore_index=0)
    temperature = torch.tensor([0.5, 0.7, 1.0, 1.3])[:, None].expand(mask.shape).contiguous()
    return SimpleNamespace(ids=ids, mask=mask, positions=positions, labels=labels, label_mask=labels != 0,
                           temperature=temperature, response_mask=mask[:, 5:])


def nested(x, mask):
    return torch.nested.nested_tensor([x[i][mask[i]] for i in range(x.shape[0])], layout=torch.jagged)


@functools.cache
def models():
    torch.manual_seed(0)
    policy = build_model(ARGS)
    value = build_model(dataclasses.replace(ARGS, value_head=True))
    stages = [build_model(ARGS, pp_rank=r, pp_size=2) for r in range(2)]
    return SimpleNamespace(policy=policy, value=value, stages=stages)


class AsMegatron(torch.nn.Module):
    """The packfwd model as a TE-backed Megatron-Core GPTModel with RoPE takes verl's calls.

    ``drop_positions``: verl passes the padded ``[b, s]`` position_ids with a packed ``[1, t]`` batch; Megatron's
    RoPE never reads them (it computes positions from the packed-sequence offsets), and packfwd's model is to
    honours given positions, so verl's reference runs without them.  The BSHD padding mask reaches the model.
    """

    def __init__(self, model, *, drop_positions=False):
        super().__init__()
        self.module, self.drop_positions = model, drop_positions

    def forward(self, input_ids=None, position_ids=None, attention_mask=None, packed_seq_params=None, **kwargs):
        if self.drop_positions and packed_seq_params is not None:
            position_ids = None
        return self.module(input_ids=input_ids, position_ids=position_ids, attention_mask=attention_mask,
                           packed_seq_params=packed_seq_params, **kwargs)

    def set_input_tensor(self, tensor):
        self.module.set_input_tensor(tensor)


def views(model, data_format):
    """(verl's model, packfwd.verl's model): see :class:`AsMegatron`."""
    return AsMegatron(model, drop_positions=True), AsMegatron(model)


# ------------------------------------------------------------------------------------------------ processors


def log_prob_processor(logits, label, label_mask, temperature):
    """verl's actor processor for ``model_forward``: temperature-scaled vocab-parallel log-probs of the labels,
    masked; and the logits themselves."""
    from megatron.core import tensor_parallel

    scaled = logits / temperature.masked_fill(temperature <= 0, 1.0).unsqueeze(-1)  # 0 at padding
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(scaled, label)
    return {"log_probs": log_probs.masked_fill(~label_mask, 0.0), "logits": logits}


def engine_processor(logits, label, temperature):
    """verl's engine processor (``_lm_head_logits_processor``), in place as verl's is."""
    from megatron.core import tensor_parallel

    temperature[temperature <= 0] = 1e-8
    logits.div_(temperature.unsqueeze(-1).to(logits.dtype))
    return {"log_probs": -tensor_parallel.vocab_parallel_cross_entropy(logits, label)}


def engine_args(b):
    """verl's engine processor arguments: label = the ids (rolled inside), per-token temperature, loss mask."""
    ids = nested(b.ids, b.mask)
    return dict(label=ids.clone(), temperature=nested(b.temperature, b.mask),
                loss_mask=nested(torch.cat([torch.zeros_like(b.mask[:, :5]), b.response_mask], 1), b.mask),
                response_attention_mask=None)


# ------------------------------------------------------------------------------------------------- comparing


def flat(out):
    """Every output as one flat tensor list (dict keys sorted; nested tensors by their values)."""
    items = [out[k] for k in sorted(out)] if isinstance(out, dict) else [out]
    return [t.values() if t.is_nested else t for t in items]


def loss_of(out, keep=None):
    """A fixed weighted sum of every output (``keep``: a 0/1 weight per token of the nested log-probs)."""
    total = 0.0
    for t in flat(out):
        w = torch.linspace(-1.0, 1.0, t.numel()).view(t.shape)
        if keep is not None and t.shape[0] == keep.shape[0] and t.dim() == 1:
            w = w * keep
        total = total + (t * w).sum()
    return total


def run(fn, modules, keep=None):
    """``fn()``'s outputs (detached) and the parameter gradients of ``loss_of`` them."""
    for m in modules:
        m.zero_grad(set_to_none=True)
    out = fn()
    loss_of(out, keep).backward()
    _sum_sequence_parallel_grads(modules)
    grads = {f"{i}.{n}": p.grad.clone() for i, m in enumerate(modules) for n, p in m.named_parameters()
             if p.grad is not None}
    return [t.detach() for t in flat(out)], grads


def _sum_sequence_parallel_grads(modules) -> None:
    """What Megatron-Core's ``finalize_model_grads`` does before a step: the gradients of parameters replicated over
    TP under sequence parallelism (norms) summed over the TP group, each rank having seen only its token slice (the
    slices differ between layouts: THD splits the packed tokens, BSHD each row's columns)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return
    from megatron.core import parallel_state as ps

    if ps.get_tensor_model_parallel_world_size() == 1:
        return
    for m in modules:
        for p in m.parameters():
            if p.grad is not None and getattr(p, "sequence_parallel", False):
                torch.distributed.all_reduce(p.grad, group=ps.get_tensor_model_parallel_group())


def max_diff(ref, ours, tol, skip=None) -> float:
    """Assert ``ours`` matches ``ref`` (lists of tensors or dicts of gradients); the largest difference."""
    if isinstance(ref, dict):
        assert ref.keys() == ours.keys()
        ref, ours = [ref[k] for k in sorted(ref)], [ours[k] for k in sorted(ours)]
    assert len(ref) == len(ours)
    worst = 0.0
    for r, o in zip(ref, ours):
        assert r.shape == o.shape, (r.shape, o.shape)
        if skip is not None and r.dim() == 1 and r.shape == skip.shape:
            r, o = r[~skip], o[~skip]
        torch.testing.assert_close(o, r, **tol)
        worst = max(worst, (o - r).abs().max().item() if r.numel() else 0.0)
    return worst


def compare(ref_fn, ours_fn, modules, keep=None, skip=None):
    ref_out, ref_grads = run(ref_fn, modules, keep)
    out, grads = run(ours_fn, modules, keep)
    return max_diff(ref_out, out, OUT_TOL, skip), max_diff(ref_grads, grads, GRAD_TOL), out


def last_tokens(b):
    """[t] bool: each sequence's last real token, in the nested order."""
    lengths = b.mask.sum(1)
    last = torch.zeros(int(lengths.sum()), dtype=torch.bool)
    last[lengths.cumsum(0) - 1] = True
    return last


# ---------------------------------------------------------------------------------------------- stand-ins


class Recorder(torch.nn.Module):
    """A stand-in model that records its keyword arguments and returns zeros of the right packed shape."""

    def __init__(self, sequence_parallel=False, fp8=None, tensor_model_parallel_size=1):
        super().__init__()
        self.config = SimpleNamespace(sequence_parallel=sequence_parallel, fp8=fp8,
                                      tensor_model_parallel_size=tensor_model_parallel_size)
        self.pre_process = self.post_process = True
        self.calls = []

    def forward(self, **kwargs):
        self.calls.append(kwargs)
        params = kwargs.get("packed_seq_params")
        if params is not None:
            return torch.zeros(1, int(params.cu_seqlens_q_padded[-1]), 3)
        return torch.zeros(*kwargs["input_ids"].shape[:2], 3)


def same_call(ref: dict, ours: dict, ignore=()):
    assert ref.keys() == ours.keys()
    for k in ref:
        if k in ignore:
            continue
        r, o = ref[k], ours[k]
        if k == "packed_seq_params":  # verl's fields, equal; packfwd's params add their CP place (layout/params.py)
            r, o = dataclasses.asdict(r), dataclasses.asdict(o)
            assert r.keys() <= o.keys() <= r.keys() | {"cp", "position_ids", "layout_pads", "bucket"} and all(
                torch.equal(r[f], o[f]) if isinstance(r[f], torch.Tensor) else r[f] == o[f] for f in r), k
        elif k == "attention_mask" and o is None and isinstance(r, torch.Tensor) and not r.is_nested:
            # BSHD without CP: packfwd passes no mask where every row's real tokens come first, so causal attention
            # over the row is verl's masked attention at every real token (and a stage hands on [w, b, h])
            real = r.bool()
            assert torch.equal(real, torch.arange(real.shape[1]) < real.sum(1, keepdim=True)), k
        elif isinstance(r, torch.Tensor) and r.is_nested:
            assert torch.equal(r.values(), o.values()) and torch.equal(r.offsets(), o.offsets()), k
        elif isinstance(r, torch.Tensor):
            assert r.dtype == o.dtype and torch.equal(r, o), k
        else:
            assert r == o, k


class Tokenwise(torch.nn.Module):
    """A stand-in model whose output at a token depends on that token's id and position only, so any split of
    the batch gives the same outputs: it checks the BSHD layout under CP, which packfwd's models do not run."""

    def __init__(self, cp_size=1):
        super().__init__()
        self.config = SimpleNamespace(sequence_parallel=False, fp8=None, context_parallel_size=cp_size)
        self.pre_process = self.post_process = True
        self.embed = torch.nn.Embedding(ARGS.vocab_size, 8)

    def forward(self, input_ids, attention_mask=None, position_ids=None, packed_seq_params=None):
        out = self.embed(input_ids)
        return out if position_ids is None else out + 0.01 * position_ids[..., None]


def tokenwise_processor(logits, label, temperature):
    return {"x": logits.sum(-1) * temperature + label}


# packfwd.verl scoring every token, as verl does (its default scores only the label / loss mask's tokens:
# tests/test_verl_dropin.py's test_scored_tokens_match_verl_there_and_are_zero_elsewhere)
EVERY = SimpleNamespace(
    model_forward_gen=lambda vision_model=False: pv.model_forward_gen(vision_model, scored_only=False),
    gptmodel_forward_model_engine=functools.partial(pv.gptmodel_forward_model_engine, scored_only=False))


def rank_cases(rank: int, world_size: int, tp: int, cp: int) -> dict:
    """On each rank of a TP x CP world: verl's forwards and packfwd.verl's on this rank's shard of the model;
    ``{case: (largest output difference, largest gradient difference)}`` (the comparisons assert)."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(tp_size=tp, cp_size=cp)
    torch.manual_seed(0)
    model = build_model(ARGS, sequence_parallel=tp > 1)
    b = batch()
    ids = nested(b.ids, b.mask)
    padded_args = dict(label=b.labels, label_mask=b.label_mask, temperature=b.temperature)
    last = last_tokens(b)
    results = {}

    def case(name, data_format, make_call, modules=(model,), ours=EVERY, **kw):
        ref_model, our_model = views(modules[0], data_format)
        with host_collectives():  # the backward of a sequence-parallel model on the CPU (packfwd.models.runtime.cpu)
            results[name] = compare(make_call(vf, ref_model), make_call(ours, our_model), list(modules), **kw)[:2]

    for fmt in ("thd", "bshd") if cp == 1 else ("thd",):
        case(f"model_forward_{fmt}", fmt, lambda f, m, fmt=fmt: functools.partial(
            f.model_forward_gen(False), m, b.ids, b.mask, b.positions, {}, data_format=fmt,
            logits_processor=log_prob_processor, logits_processor_args=padded_args))
    engine = [("thd", {}), ("thd_bucket", dict(pad_to_length_bucket=8 * tp * cp))] + ([("bshd", {})] if cp == 1 else [])
    for name, kw in engine:
        fmt = name.split("_")[0]
        case(f"engine_{name}", fmt, lambda f, m, fmt=fmt, kw=kw: lambda: f.gptmodel_forward_model_engine(
            m, ids, {}, logits_processor=engine_processor, logits_processor_args=engine_args(b), data_format=fmt,
            **kw), keep=(~last).float(), skip=last)
    # packfwd.verl's default: the tokens whose next token is in the loss mask only (verl's there, 0 elsewhere,
    # checked by the zeros: skip leaves them out of the comparison with verl's numbers)
    scored = torch.zeros_like(b.mask)
    scored[:, :-1] = (torch.cat([torch.zeros_like(b.mask[:, :5]), b.response_mask], 1) & b.mask)[:, 1:]
    scored = scored[b.mask]
    for fmt in ("thd", "bshd") if cp == 1 else ("thd",):
        got = []
        case(f"engine_{fmt}_scored", fmt, lambda f, m, fmt=fmt: lambda: got.append(f.gptmodel_forward_model_engine(
            m, ids, {}, logits_processor=engine_processor, logits_processor_args=engine_args(b),
            data_format=fmt)) or got[-1], ours=pv, keep=scored.float(), skip=~scored)
        assert not got[-1]["log_probs"].values()[~scored].any() and got[0]["log_probs"].values()[~scored].any()
    if cp > 1:
        with pytest.raises(ValueError, match="context parallelism"):
            pv.model_forward_gen(False)(model, b.ids, b.mask, b.positions, {}, data_format="bshd")
        toy = Tokenwise(cp)
        args = dict(label=ids.clone(), temperature=engine_args(b)["temperature"])
        for name, kw in [("thd", {}), ("bshd", {}), ("bshd_forced", dict(forced_max_seqlen=13))]:
            case(f"engine_{name}_tokenwise", "thd", lambda f, m, kw=kw, fmt=name.split("_")[0]: lambda: (
                f.gptmodel_forward_model_engine(m, ids, {}, logits_processor=tokenwise_processor,
                                                logits_processor_args=dict(args), data_format=fmt, **kw)),
                 modules=(toy,), keep=(~last).float(), skip=last)
    ps.destroy_model_parallel()
    return {"cases": results}
