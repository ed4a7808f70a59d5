"""Batch invariance and a deterministic backward, on the CPU (the GPU versions: tests/gpu/test_batch_invariance_cuda.py
and tests/gpu/test_deterministic_cuda.py; what is promised where: docs/guarantees.md).

Strategy.  A target sequence's forward outputs (log-probs, entropy, logits; the fused head's) are computed in
compositions drawn by Hypothesis: alone (b=1), with neighbours before / after / around it, the batch reversed,
among many very short sequences, and through ``run_micro_batches`` at two token budgets.  What is checked here:

* bitwise, by construction, on any device: a plan's gather moves the target's rows without arithmetic (float64
  values come back with the same bits whatever the neighbours), and its backward is a permutation (the input
  gradient is the output gradient moved, never summed: no atomics can be involved);
* within rounding (the CPU's GEMMs block by the batch size, so bits may differ: float32 ~1e-5, float64 ~1e-12):
  the model's outputs, dense and MoE (dropless routing: the token's experts do not depend on the batch), CP=1
  against CP=2 over gloo;
* the options of ``make_forward``: ``batch_invariant=True`` is refused on the CPU and for layouts it is not built
  for; ``deterministic=True`` refuses to run without torch's deterministic mode;
* parameter gradients accumulated over micro-batch compositions of one global batch (the whole batch, halves,
  thirds, one sequence at a time) agree within rounding (the accumulation order differs).

A deterministic backward (two backward passes, the same bits) is checked on the GPU only
(``tests/gpu/test_deterministic_cuda.py``): the CPU's kernels have no atomics, so the same check here could not
fail, and "two micro-batches in either order" (g1 + g2 == g2 + g1) cannot fail anywhere (IEEE addition commutes).
"""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import packfwd as pf
from packfwd.forward import deterministic as det
from packfwd.logits import log_probs_and_entropy
from packfwd.micro import plan_micro_batches, run_micro_batches
from packfwd.models import ModelArgs, build_model
from packfwd.models.mlp import Moe

ARGS = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                 num_query_groups=2)
MOE_ARGS = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=2, num_attention_heads=4,
                     num_query_groups=2, moe=Moe(num_experts=4, top_k=2, ffn_hidden_size=32))
# within rounding on the CPU: float32 GEMMs reduce in blocks chosen by the batch size
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float64: dict(atol=1e-12, rtol=1e-12)}
CASES = ("alone", "before", "after", "between", "reversed", "many_short")


# ------------------------------------------------------------------------------------------------ helpers


def random_sequences(lengths, vocab: int, seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (n,), generator=g) for n in lengths]


def padded(seqs, device="cpu"):
    """Right-padded ``ids, mask [b, s]`` of a list of 1-D id tensors."""
    s = max(len(x) for x in seqs)
    ids = torch.zeros(len(seqs), s, dtype=torch.long)
    mask = torch.zeros(len(seqs), s, dtype=torch.bool)
    for i, x in enumerate(seqs):
        ids[i, : len(x)], mask[i, : len(x)] = x, True
    return ids.to(device), mask.to(device)


def composition(case: str, target, others, shorts):
    """(the batch's sequences, the target's row) of a named composition."""
    k = len(others) // 2
    rows = {
        "alone": [target],
        "before": [target, *others],
        "after": [*others, target],
        "between": [*others[:k], target, *others[k:]],
        "reversed": [target, *reversed(others)],  # the "after" batch, reversed
        "many_short": [*shorts, target],
    }[case]
    return rows, next(i for i, x in enumerate(rows) if x is target)


def outputs(forward, model, seqs, row: int, *, with_labels: bool = True) -> dict:
    """The forward's outputs of sequence ``row``, cut to its real tokens: ``{name: [n, ...]}``."""
    ids, mask = padded(seqs, next(model.parameters()).device)
    kwargs = {"labels": pf.next_token_labels(ids, mask)} if with_labels else {}
    with torch.no_grad():
        out = forward(model, ids, mask, **kwargs)
    out = out if isinstance(out, dict) else {"logits": out}
    n = len(seqs[row])
    return {k: v[row, :n] for k, v in out.items()}


def differences(got: dict, want: dict) -> dict:
    """``{name: (bitwise equal, max |diff|)}``."""
    return {k: (torch.equal(got[k], want[k]), float((got[k].double() - want[k].double()).abs().max()))
            for k in want}


@functools.lru_cache(maxsize=None)
def model_of(args: ModelArgs, dtype: torch.dtype):
    torch.manual_seed(0)
    return build_model(args, params_dtype=dtype).eval()


compositions = st.fixed_dictionaries({
    "target": st.integers(1, 96),
    "others": st.lists(st.integers(1, 96), min_size=1, max_size=6),
    "shorts": st.lists(st.integers(1, 4), min_size=4, max_size=24),
    "seed": st.integers(0, 2**16),
})


# ------------------------------------------------------------------------------- bitwise by construction


@settings(max_examples=30)
@given(comp=compositions)
def test_plan_moves_a_sequences_rows_bitwise_whatever_its_neighbours(comp):
    """float64 rows through to_thd and back: the target's rows are the same bits alone and in every composition,
    and the backward of the packing is a permutation of the output gradient (no sum: nothing to be atomic)."""
    target = random_sequences([comp["target"]], 1 << 20, comp["seed"])[0]
    others = random_sequences(comp["others"], 1 << 20, comp["seed"] + 1)
    shorts = random_sequences(comp["shorts"], 1 << 20, comp["seed"] + 2)
    for case in CASES:
        seqs, row = composition(case, target, others, shorts)
        ids, mask = padded(seqs)
        x = torch.randn(*ids.shape, 3, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
        x[row, : len(target)] = target[:, None].double() / 7  # the target's own values
        x.requires_grad_(True)
        packed, info = pf.to_thd(x, mask)
        g = torch.randn(packed.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
        (packed * g).sum().backward()
        start = int(info.cu_seqlens_padded[row])
        mine = packed[start : start + len(target)]
        assert torch.equal(mine, target[:, None].double().expand(-1, 3) / 7), case
        assert torch.equal(x.grad[row, : len(target)], g[start : start + len(target)]), case  # moved, not summed
        assert not x.grad[~mask].any(), case  # padding receives nothing
        back = pf.from_thd(packed.detach(), info)
        assert torch.equal(back[row, : len(target)], x.detach()[row, : len(target)]), case


# ------------------------------------------------------------------------------------- within rounding


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("head", ["logits", "fused"])
@settings(max_examples=6)
@given(comp=compositions)
def test_a_sequences_outputs_agree_within_rounding_in_every_composition(dtype, head, comp):
    model = model_of(ARGS, dtype)
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy, head=head)
    target = random_sequences([comp["target"]], ARGS.vocab_size, comp["seed"])[0]
    others = random_sequences(comp["others"], ARGS.vocab_size, comp["seed"] + 1)
    shorts = random_sequences(comp["shorts"], ARGS.vocab_size, comp["seed"] + 2)
    alone = outputs(forward, model, [target], 0)
    for case in CASES[1:]:
        seqs, row = composition(case, target, others, shorts)
        got = outputs(forward, model, seqs, row)
        for k in alone:
            torch.testing.assert_close(got[k], alone[k], **TOL[dtype], msg=f"{case} {k} {comp}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_logits_and_micro_batch_budgets_agree_within_rounding(dtype):
    model = model_of(ARGS, dtype)
    lengths = [1, 2, 3, 64, 5, 17, 90, 33, 8, 1, 47, 60]
    seqs = random_sequences(lengths, ARGS.vocab_size, 3)
    plain = pf.make_forward("thd")
    for row in (0, 3, 6):
        torch.testing.assert_close(outputs(plain, model, seqs, row, with_labels=False)["logits"],
                                   outputs(plain, model, [seqs[row]], 0, with_labels=False)["logits"], **TOL[dtype])
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    ids, mask = padded(seqs)
    labels = pf.next_token_labels(ids, mask)
    alone = [outputs(forward, model, [x], 0) for x in seqs]
    for budget in (96, 200):
        plan = plan_micro_batches(lengths, max_tokens=budget, **forward.layout.plan_args)
        assert len(plan.micro_batches[0]) > 1
        out = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, labels=labels).outputs
        for i, n in enumerate(lengths):
            for k in alone[i]:
                torch.testing.assert_close(out[k][i, :n], alone[i][k], **TOL[dtype], msg=f"budget {budget} row {i}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_moe_sequence_alone_and_batched_agree_within_rounding(dtype):
    """Dropless routing: each token's experts and weights come from its own hidden state, so only the experts'
    GEMM shapes (their token counts) change with the batch: the outputs agree within rounding."""
    model = model_of(MOE_ARGS, dtype)
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    seqs = random_sequences([40, 3, 77, 1, 25, 60], MOE_ARGS.vocab_size, 5)
    for row in (0, 2, 3):
        got = outputs(forward, model, seqs, row)
        want = outputs(forward, model, [seqs[row]], 0)
        for k in want:
            torch.testing.assert_close(got[k], want[k], **TOL[dtype], msg=f"row {row} {k}")


def _cp_worker(rank: int, world: int, state: dict, dtype, ids, mask):
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(cp_size=world)
    model = build_model(ARGS, params_dtype=dtype)
    model.load_state_dict(state)
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy, cp_size=world,
                              cp_rank=ps.get_context_parallel_rank(), cp_group=ps.get_context_parallel_group())
    with torch.no_grad():
        out = forward(model.eval(), ids, mask, labels=pf.next_token_labels(ids, mask))
    ps.destroy_model_parallel()
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_cp2_over_gloo_agrees_with_cp1_within_rounding(dtype):
    """CP=2 splits each sequence in zigzag chunks and merges the attention of the chunks: not the same sums as
    CP=1, so the log-probs agree within rounding (printed: the measured max |diff|)."""
    from packfwd.testing import run_local

    model = model_of(ARGS, dtype)
    seqs = random_sequences([30, 7, 64, 1, 19], ARGS.vocab_size, 11)
    ids, mask = padded(seqs)
    with torch.no_grad():
        want = pf.make_forward("thd", logits_processor=log_probs_and_entropy)(
            model, ids, mask, labels=pf.next_token_labels(ids, mask))
    ranks = run_local(_cp_worker, 2, model.state_dict(), dtype, ids, mask, backend="gloo", timeout=300)
    for got in ranks:
        for k in want:
            diff = float((got[k] - want[k]).abs().max())
            print(f"cp2 vs cp1 {dtype} {k}: max |diff| {diff:.3g}, bitwise {torch.equal(got[k], want[k])}")
            torch.testing.assert_close(got[k], want[k], **TOL[dtype])


# ----------------------------------------------------------------------------------------- the options


def test_batch_invariant_is_refused_where_it_is_not_a_guarantee():
    model = model_of(ARGS, torch.float32)
    ids, mask = padded(random_sequences([5, 3], ARGS.vocab_size, 0))
    with pytest.raises(ValueError, match="CUDA guarantee"):
        pf.make_forward("thd", batch_invariant=True)(model, ids, mask)
    with pytest.raises(ValueError, match="data_format='thd'"):
        pf.make_forward("bshd", batch_invariant=True)
    with pytest.raises(ValueError, match="tp_size > 1"):
        pf.make_forward("thd", tp_size=2, batch_invariant=True)
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        pf.make_forward("thd", deterministic=1)
    # no batch smaller than a GEMM tile: every sequence aligned to 16 rows (a lone 1-token sequence took other
    # cuBLAS kernels on the H200); a given alignment must be a multiple of 16
    assert pf.make_forward("thd", batch_invariant=True).layout == pf.make_forward("thd", seq_align=16).layout
    assert pf.make_forward("thd", batch_invariant=True, seq_align=32).layout.seq_align == 32
    assert pf.make_forward("thd", cp_size=3, cp_rank=0, cp_group=object(), batch_invariant=True).layout.seq_align == 48
    with pytest.raises(ValueError, match="multiple of 16"):
        pf.make_forward("thd", seq_align=8, batch_invariant=True)


def test_batch_invariant_checks_the_cublas_state(monkeypatch):
    """On CUDA the option refuses to run with split-K allowed or the cuBLAS backend (checked here by pretending
    the inputs are on CUDA; the GPU test runs it for real)."""
    with pytest.raises(RuntimeError, match="split-K off"):
        det.check("cuda", deterministic=False, batch_invariant=True)
    monkeypatch.setattr(det, "_blas_name", lambda: "cublaslt")
    previous = det.state()
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = (False, False)
        torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = (False, False)
        det.check("cuda", deterministic=False, batch_invariant=True)  # the state it needs: no error
    finally:
        det.restore(previous)


def test_deterministic_refuses_to_run_without_torchs_deterministic_mode(monkeypatch):
    model = model_of(ARGS, torch.float32)
    ids, mask = padded(random_sequences([5, 3], ARGS.vocab_size, 0))
    forward = pf.make_forward("thd", deterministic=True)
    assert not torch.are_deterministic_algorithms_enabled()
    with pytest.raises(RuntimeError, match="use_deterministic_algorithms"):
        forward(model, ids, mask)
    previous = det.state()
    try:
        torch.use_deterministic_algorithms(True, warn_only=True)
        with pytest.raises(RuntimeError, match="not warn_only"):
            forward(model, ids, mask)
    finally:
        det.restore(previous)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    with det.enabled(batch_invariant=False):
        assert torch.are_deterministic_algorithms_enabled()
        forward(model, ids, mask)  # runs
        with pytest.raises(RuntimeError, match="CUBLAS_WORKSPACE_CONFIG"):
            monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":0:0")
            det.check("cuda", deterministic=True, batch_invariant=False)
    assert not torch.are_deterministic_algorithms_enabled()  # restored


def _grads(model, forward, ids, mask, order):
    """Parameter gradients of a summed log-prob loss over the micro-batches ``order`` (lists of rows), accumulated
    in that order as run_micro_batches does."""
    model.zero_grad(set_to_none=True)
    labels = pf.next_token_labels(ids, mask)
    for rows in order:
        out = forward(model, ids[rows], mask[rows], labels=labels[rows])
        (out["log_probs"].sum() + out["entropy"][mask[rows]].sum() * 1e-2).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_micro_batch_compositions_accumulate_the_same_gradients_within_rounding():
    """The whole batch is the oracle: halves, thirds and one sequence at a time sum to its gradients (a dropped, a
    doubled or a mis-masked sequence would be off by far more than rounding)."""
    torch.manual_seed(0)
    model = build_model(ARGS).train()
    ids, mask = padded(random_sequences([20, 3, 41, 9, 1, 30], ARGS.vocab_size, 2))
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    whole = _grads(model, forward, ids, mask, [[0, 1, 2, 3, 4, 5]])
    for order in ([[0, 1, 2], [3, 4, 5]], [[4, 5], [0, 1], [2, 3]], [[i] for i in (5, 0, 3, 1, 4, 2)]):
        got = _grads(model, forward, ids, mask, order)
        for name in whole:
            torch.testing.assert_close(got[name], whole[name], atol=1e-4, rtol=1e-4, msg=f"{order}: {name}")
    short = _grads(model, forward, ids, mask, [[0, 1, 2], [3, 4]])  # the control: one sequence left out
    assert any(not torch.allclose(short[n], whole[n], atol=1e-4, rtol=1e-4) for n in whole)


# ----------------------------------------------------------------------- across parallel layouts, over gloo
# TP=2 (+SP) and CP=2 against one process, on the CPU (the NCCL comparison needs two GPUs: bench_invariance (c)).
# Bound: units of eps * max |want| (about an ulp of the largest value): measured on this batch and 4 others (1-250
# tokens), float32 and float64 alike: logits at most 2.7 (largest |logit| ~0.7), log-probs and entropy at most 1.5
# (largest ~5, about ln 128: one ulp of a row's own value).  8 leaves room for another CPU's GEMM blocking.

ULP_BOUND = 8


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    """max |got - want| in units of eps * max |want|."""
    return float((got.double() - want.double()).abs().max()) / (torch.finfo(want.dtype).eps *
                                                                  float(want.abs().max()))


def _tp_shards(state: dict, tp: int) -> list[dict]:
    from packfwd.models.convert.hf_weights import hf_to_megatron, megatron_to_hf

    hf = megatron_to_hf([state], ARGS)
    return [hf_to_megatron(hf, ARGS, tp_size=tp, tp_rank=r) for r in range(tp)]


def _layouts_worker(rank: int, world: int, states: dict, ids, mask, pieces: dict):
    """TP=2 with and without SP, then CP=2, for each dtype: this rank's outputs (and the TP pieces' inputs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.convert.hf import load_weights
    from packfwd.models.runtime import ensure_model_parallel

    labels, out = pf.next_token_labels(ids, mask), {}
    for dtype, (whole, shards) in states.items():
        ensure_model_parallel(tp_size=world)
        for sp in (True, False):
            model = load_weights(build_model(ARGS, params_dtype=dtype, tp_size=world, sequence_parallel=sp),
                                 shards[rank]).eval()
            with torch.no_grad():
                got = pf.make_forward("thd", logits_processor=log_probs_and_entropy, tp_size=world)(
                    model, ids, mask, labels=labels)
                got["logits"] = pf.make_forward("thd", tp_size=world)(model, ids, mask)  # [b, s, v / 2]
            out[dtype, "tp", sp] = got
        x, logits, lab = (p.to(dtype) if p.is_floating_point() else p for p in pieces.values())
        k, v = x.shape[-1] // world, logits.shape[-1] // world
        with torch.no_grad():  # the row-parallel output projection of layer 0 (no SP: all-reduced), on its heads
            out[dtype, "row_parallel"] = model.decoder.layers[0].self_attention.linear_proj(
                x[..., rank * k : (rank + 1) * k].contiguous())[0]
        out[dtype, "vocab_parallel"] = log_probs_and_entropy(
            logits[:, rank * v : (rank + 1) * v].contiguous(), lab, tp_group=dist.group.WORLD)
        ps.destroy_model_parallel()
        ensure_model_parallel(cp_size=world)
        model = load_weights(build_model(ARGS, params_dtype=dtype), whole).eval()
        kw = {"cp_size": world, "cp_rank": ps.get_context_parallel_rank(), "cp_group": ps.get_context_parallel_group()}
        with torch.no_grad():
            got = pf.make_forward("thd", logits_processor=log_probs_and_entropy, **kw)(model, ids, mask,
                                                                                      labels=labels)
            got["logits"] = pf.make_forward("thd", **kw)(model, ids, mask)  # all-gathered: the whole batch
        out[dtype, "cp"] = got
        ps.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def layouts():
    """One gloo run of every two-rank case: ``(one process's outputs, the pieces, the ranks' outputs)``."""
    from packfwd.testing import run_local

    ids, mask = padded(random_sequences([30, 7, 64, 1, 19], ARGS.vocab_size, 11))
    labels = pf.next_token_labels(ids, mask)
    g = torch.Generator().manual_seed(3)
    pieces = {"x": torch.randn(37, 1, ARGS.hidden_size, generator=g, dtype=torch.float64),  # [t, b, h]
              "logits": 3 * torch.randn(37, ARGS.vocab_size, generator=g, dtype=torch.float64),
              "labels": torch.randint(-1, ARGS.vocab_size, (37,), generator=g)}
    states, want = {}, {}
    for dtype in (torch.float32, torch.float64):
        model = model_of(ARGS, dtype)
        whole = {k: p.detach().clone() for k, p in model.named_parameters()}
        states[dtype] = (whole, _tp_shards(whole, 2))
        with torch.no_grad():
            want[dtype] = pf.make_forward("thd", logits_processor=log_probs_and_entropy)(model, ids, mask,
                                                                                        labels=labels)
            want[dtype]["logits"] = pf.make_forward("thd")(model, ids, mask)
    return want, pieces, run_local(_layouts_worker, 2, states, ids, mask, pieces, backend="gloo", timeout=300)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["tp2_sp", "tp2", "cp2"])
def test_tp2_and_cp2_move_outputs_by_a_few_ulps_over_gloo(layouts, dtype, kind):
    """TP=2 (with and without SP) and CP=2 against one process: logits, log-probs and entropy within
    ``ULP_BOUND`` units of eps * max |value| (printed: the max |diff|, in ulps, and whether bitwise).  Not
    bitwise by construction (see the tests below and docs/guarantees.md): TP's row-parallel layers sum two
    half-K products, CP's ranks run attention and GEMMs on other shapes."""
    want, _, ranks = layouts
    key = {"tp2_sp": (dtype, "tp", True), "tp2": (dtype, "tp", False), "cp2": (dtype, "cp")}[kind]
    for rank, out in enumerate(ranks):
        got = dict(out[key])
        if kind != "cp2":  # each rank's vocab slice, in rank order
            got["logits"] = torch.cat([r[key]["logits"] for r in ranks], -1)
        for name, w in want[dtype].items():
            d, ulps = float((got[name].double() - w.double()).abs().max()), _ulps(got[name], w)
            print(f"{kind} vs 1, rank {rank}, {dtype} {name}: max |diff| {d:.3g} ({ulps:.2f} ulp of max "
                  f"|{name}| {float(w.abs().max()):.3g}), bitwise {torch.equal(got[name], w)}")
            assert ulps <= ULP_BOUND, (kind, rank, name, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tp2_sequence_parallelism_changes_no_bit(layouts, dtype):
    """SP only moves rows: the reduce-scatter adds the same two partials as the all-reduce (a + b == b + a), the
    norms and the pointwise layers are per token, the column-parallel GEMMs see the all-gathered rows."""
    _, _, ranks = layouts
    for out in ranks:
        for name, x in out[dtype, "tp", True].items():
            assert torch.equal(x, out[dtype, "tp", False][name]), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_tp2_row_parallel_is_bitwise_only_the_sum_of_the_same_two_half_products(layouts, dtype):
    """Megatron's row-parallel linear (layer 0's attention output projection) over 2 ranks is bitwise
    ``x[:, :k/2] @ W[:, :k/2].T + x[:, k/2:] @ W[:, k/2:].T`` (2 terms: the all-reduce's order cannot matter),
    and so equal to TP=1's one GEMM over the whole k only within rounding: a fixed reduction order makes TP=2
    equal TP=1 only if TP=1 also summed those two halves."""
    _, pieces, ranks = layouts
    model = model_of(ARGS, dtype)
    layer = model.decoder.layers[0].self_attention.linear_proj
    x, w = pieces["x"].to(dtype), layer.weight.detach()
    k = x.shape[-1] // 2
    halves = torch.matmul(x[..., :k], w[:, :k].t()) + torch.matmul(x[..., k:], w[:, k:].t())
    with torch.no_grad():
        one = layer(x)[0]
    for out in ranks:
        assert torch.equal(out[dtype, "row_parallel"], halves)
    d = float((halves - one).abs().max())
    print(f"row-parallel {dtype}: vs the two halves bitwise; vs TP=1's one GEMM max |diff| {d:.3g} "
          f"({_ulps(halves, one):.2f} ulp), bitwise {torch.equal(halves, one)}")
    assert _ulps(halves, one) <= ULP_BOUND


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_vocab_parallel_log_probs_are_bitwise_the_merge_of_the_two_half_vocab_blocks(layouts, dtype):
    """On the same logits, the vocab-parallel log-probs and entropy over 2 ranks are bitwise what one process
    gets by merging the statistics of the two half-vocab blocks (``logits._merge``), and equal to the whole-row
    reduction of TP=1 within rounding only: TP=1 sums exp over the whole row in one torch reduction, TP=2 sums
    each half, rescales the half without the max by exp(m_r - m) and adds the two."""
    from packfwd import logits as lg

    _, pieces, ranks = layouts
    logits, labels = pieces["logits"].to(dtype), pieces["labels"]
    whole = log_probs_and_entropy(logits, labels)
    t, v = logits.shape
    inv_t = torch.ones(t, dtype=dtype)
    blocks = [lg._block_stats(logits[:, c : c + v // 2], inv_t, *lg._label_columns(labels, c, v // 2), True, True)
              for c in (0, v // 2)]
    m, s, e, zl, _ = lg._merge(*blocks, inv_t)
    *_, logp, ent = lg._finish(m, s, e, zl, labels >= 0)
    for out in ranks:
        assert torch.equal(out[dtype, "vocab_parallel"]["log_probs"], logp)
        assert torch.equal(out[dtype, "vocab_parallel"]["entropy"], ent)
    for name, got in (("log_probs", logp), ("entropy", ent)):
        print(f"vocab-parallel {dtype} {name}: vs the half-vocab merge bitwise; vs TP=1 max |diff| "
              f"{float((got - whole[name]).abs().max()):.3g} ({_ulps(got, whole[name]):.2f} ulp), "
              f"bitwise {torch.equal(got, whole[name])}")
        assert _ulps(got, whole[name]) <= ULP_BOUND
