"""Tests for packfwd.parallel.context and .gather: context-parallel causal attention over the THD zigzag layout,
and the CP all-gather with each of its two backward rules.

Strategy: the oracle is single-process causal attention over the whole padded sequences (PyTorch's
``scaled_dot_product_attention`` in float64, one sequence at a time, GQA by repeating K/V heads), and the
zigzag shards are cut from the global tensors with a plain per-sequence loop (``_local_positions``), not with
packfwd's index arithmetic.  Real gloo processes (``run_local``, cp=2 and cp=3) run
``context_parallel_attention`` on their shards with packfwd's reference varlen kernel as ``attn_fn``; each rank's
output must equal the oracle's rows at its positions, and the gradients of q, k, v, put back in global order,
must equal the oracle's gradients.  The cases cover ragged sequences, chunks made only of padding, an empty
sequence, GQA and MHA.  The all-gather's backward is checked by hand for both rules: ``"sum"`` (every rank's loss
differs) and ``"local"`` (every rank computes the same loss).  The index maps are checked against the loop on
random layouts (Hypothesis).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from packfwd.models.mixers.varlen import varlen_attention_reference
from packfwd.parallel import all_gather_cp, context_parallel_attention, zigzag_to_global
from packfwd.parallel.context import _zigzag_global_index, plan_zigzag_attention
from packfwd.testing import run_local

TOL = dict(rtol=1e-10, atol=1e-10)


@dataclass(frozen=True)
class Case:
    name: str
    real: tuple[int, ...]  # real tokens per sequence
    padded: tuple[int, ...]  # padded lengths, multiples of 2*cp
    hq: int
    hkv: int
    d: int = 8

    @property
    def cu(self) -> torch.Tensor:
        return torch.tensor([0, *torch.tensor(self.padded).cumsum(0).tolist()], dtype=torch.int32)


CASES = {
    2: [
        Case("ragged_gqa", real=(5, 1, 12), padded=(8, 4, 12), hq=4, hkv=2),  # seq 1: chunks 1..3 all padding
        Case("empty_and_pad_chunks_mha", real=(0, 3, 9), padded=(0, 8, 12), hq=2, hkv=2),
        Case("one_long_mqa", real=(15,), padded=(16,), hq=3, hkv=1),
    ],
    3: [
        Case("ragged_gqa", real=(2, 17, 12), padded=(6, 18, 12), hq=4, hkv=2),  # seq 0: chunks 2..5 padding
        Case("pad_heavy_mha", real=(1, 7), padded=(6, 12), hq=2, hkv=2),
    ],
}


# ------------------------------------------------------------------------------------------------ oracles


def _local_positions(padded: list[int], cp: int, rank: int) -> list[int]:
    """Global positions held by CP rank ``rank``, by the layout's definition: chunks ``rank`` and ``2cp-1-rank``
    of each padded sequence, sequence after sequence."""
    out, start = [], 0
    for p in padded:
        c = p // (2 * cp)
        for j in (rank, 2 * cp - 1 - rank):
            out += range(start + j * c, start + (j + 1) * c)
        start += p
    return out


def _dense_causal(q, k, v, padded):
    """Causal attention of each whole padded sequence, one at a time (float64 SDPA), GQA by repeating K/V."""
    group = q.shape[1] // k.shape[1]
    outs, start = [], 0
    for p in padded:
        if p:
            qs, ks, vs = (x[start : start + p].transpose(0, 1) for x in (q, k, v))  # [h, p, d]
            ks, vs = ks.repeat_interleave(group, 0), vs.repeat_interleave(group, 0)
            outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
        start += p
    return torch.cat(outs)


def _global_inputs(case: Case, seed: int):
    g = torch.Generator().manual_seed(seed)
    t = sum(case.padded)
    q = torch.randn(t, case.hq, case.d, generator=g, dtype=torch.float64)
    k = torch.randn(t, case.hkv, case.d, generator=g, dtype=torch.float64)
    v = torch.randn(t, case.hkv, case.d, generator=g, dtype=torch.float64)
    grad_out = torch.randn(t, case.hq, case.d, generator=g, dtype=torch.float64)
    real = torch.zeros(t, dtype=torch.bool)  # pads are zero rows, as the THD transforms leave them
    start = 0
    for n, p in zip(case.real, case.padded):
        real[start : start + n] = True
        start += p
    q, k, v = (x * real[:, None, None] for x in (q, k, v))
    return q, k, v, grad_out


# ---------------------------------------------------------------------------------- worker (spawned by gloo)


def _cp_worker(rank: int, cp: int, cases: list[Case]):
    results = []
    for i, case in enumerate(cases):
        q, k, v, grad_out = _global_inputs(case, seed=i)
        pos = torch.tensor(_local_positions(list(case.padded), cp, rank), dtype=torch.long)
        ql, kl, vl = (x[pos].clone().requires_grad_(True) for x in (q, k, v))
        out = context_parallel_attention(
            ql, kl, vl, case.cu, max(case.padded), cp_size=cp, cp_rank=rank, cp_group=None,
            attn_fn=varlen_attention_reference,
        )
        (out * grad_out[pos]).sum().backward()
        # The gather + reorder alone must reproduce the global tensor (forward) ...
        regathered = zigzag_to_global(all_gather_cp(q[pos], None, backward="sum"), case.cu)
        results.append((out.detach(), ql.grad, kl.grad, vl.grad, regathered))
    # ... and all_gather_cp's backward "sum" returns to each rank the sum of every rank's gradient for its slot,
    x = torch.full((3, 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    weights = torch.arange(cp, dtype=torch.float64)[:, None, None] + 10.0 * rank  # rank-dependent
    gathered = all_gather_cp(x, None, backward="sum")
    (gathered * weights).sum().backward()
    # while "local" (every rank computes the same loss) keeps this rank's own gradient for its slot.
    z = torch.full((3, 2), float(rank + 1), dtype=torch.float64, requires_grad=True)
    same = torch.arange(cp, dtype=torch.float64)[:, None, None] + 1.0  # the same weights on every rank
    (all_gather_cp(z, None, backward="local") * same).sum().backward()
    # The group check: a cp_rank that is not this process's rank in the group is refused, naming both.
    try:
        context_parallel_attention(ql, kl, vl, case.cu, max(case.padded), cp_size=cp, cp_rank=(rank + 1) % cp,
                                   cp_group=None, attn_fn=varlen_attention_reference)
        group_error = None
    except ValueError as exc:
        group_error = str(exc)
    return results, gathered.detach(), (x.grad, z.grad), group_error


@functools.lru_cache(maxsize=None)
def _run(cp: int) -> list:
    """One gloo run per cp size, shared by the tests below (each run spawns cp processes)."""
    return run_local(_cp_worker, cp, CASES[cp], backend="gloo", timeout=120)


CASE_IDS = [(cp, i) for cp in CASES for i in range(len(CASES[cp]))]


# ----------------------------------------------------------------------------------------- process tests


@pytest.mark.parametrize("cp, index", CASE_IDS, ids=[f"cp{cp}-{CASES[cp][i].name}" for cp, i in CASE_IDS])
def test_output_and_grads_match_single_process(cp, index):
    per_rank = _run(cp)
    case = CASES[cp][index]
    q, k, v, grad_out = _global_inputs(case, seed=index)
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    expected = _dense_causal(q, k, v, case.padded)
    (expected * grad_out).sum().backward()

    grads = [torch.full_like(x, float("nan")) for x in (q, k, v)]
    covered = torch.zeros(q.shape[0], dtype=torch.long)
    for rank, (results, *_) in enumerate(per_rank):
        out, gq, gk, gv, regathered = results[index]
        pos = torch.tensor(_local_positions(list(case.padded), cp, rank), dtype=torch.long)
        torch.testing.assert_close(out, expected.detach()[pos], **TOL, msg=f"{case.name}: output of rank {rank}")
        torch.testing.assert_close(regathered, q.detach(), rtol=0, atol=0)
        for g, local in zip(grads, (gq, gk, gv)):
            g[pos] = local
        covered[pos] += 1
    assert covered.eq(1).all(), "the loop oracle must give every global position to exactly one rank"
    for name, g, ref in zip("qkv", grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(g, ref, **TOL, msg=f"{case.name}: grad of {name}")


@pytest.mark.parametrize("cp", sorted(CASES))
def test_all_gather_cp_forward_and_backward(cp):
    per_rank = _run(cp)
    for rank, (_, gathered, (x_grad, z_grad), _) in enumerate(per_rank):
        expected = torch.stack([torch.full((3, 2), float(r + 1), dtype=torch.float64) for r in range(cp)])
        torch.testing.assert_close(gathered, expected, rtol=0, atol=0)
        # "sum": rank s weights slot r by r + 10 s; rank r's input gets the sum over s: cp * r + 10 * (0 + ... + cp-1).
        want = cp * rank + 10.0 * sum(range(cp))
        torch.testing.assert_close(x_grad, torch.full((3, 2), want, dtype=torch.float64), rtol=0, atol=0)
        # "local": every rank weights slot r by r + 1; rank r's input gets that once, not cp times.
        torch.testing.assert_close(z_grad, torch.full((3, 2), rank + 1.0, dtype=torch.float64), rtol=0, atol=0)


def test_all_gather_cp_names_its_backward_rules():
    with pytest.raises(ValueError, match="'sum'.*'local'"):
        all_gather_cp(torch.zeros(2), None, backward="mean")


@pytest.mark.parametrize("cp", sorted(CASES))
def test_wrong_cp_rank_is_refused(cp):
    per_rank = _run(cp)
    for rank, (_, _, _, group_error) in enumerate(per_rank):
        assert group_error is not None
        assert f"its rank {rank}" in group_error and f"cp_rank={(rank + 1) % cp}" in group_error


def _cp_sources_worker(rank: int, world: int):
    """World of 4, CP groups {0, 1} and {2, 3} (the model's), and {0, 2}, {1, 3} of the same size (not the model's):
    ``check_cp`` accepts the model's group and refuses the other, whose gather would mix other ranks' outputs."""
    from types import SimpleNamespace

    from packfwd.engine.facts import check_cp

    groups = {ranks: dist.new_group(list(ranks)) for ranks in ((0, 1), (2, 3), (0, 2), (1, 3))}
    mine = groups[(0, 1) if rank < 2 else (2, 3)]
    other = groups[(0, 2) if rank % 2 == 0 else (1, 3)]
    model = SimpleNamespace(config=SimpleNamespace(context_parallel_size=2), pg_collection=SimpleNamespace(cp=mine))
    check_cp(model, 2, mine.rank(), mine)
    errors = []
    for args in ((2, mine.rank(), other), (2, 1 - mine.rank(), mine)):
        try:
            check_cp(model, *args)
        except ValueError as exc:
            errors.append(str(exc))
    return errors, other.rank() == mine.rank()


def test_the_gather_group_must_be_the_attentions():
    results = run_local(_cp_sources_worker, 4, backend="gloo", timeout=120)
    for errors, same_rank in results:
        assert len(errors) == 2
        # where this process has the same rank in both groups, only the group's members tell them apart
        assert ("the model's attention communicates over ranks" if same_rank else "cp_group has 2 ranks") in errors[0]
        assert "but the model's attention runs as CP rank" in errors[1]
    assert [same for _, same in results] == [True, False, False, True]


# ------------------------------------------------------------------------------------ single-process tests


@st.composite
def layouts(draw):
    cp = draw(st.integers(1, 4))
    padded = draw(st.lists(st.integers(0, 4).map(lambda m: m * 2 * cp), min_size=1, max_size=5))
    return cp, padded


def _cu(padded):
    return torch.tensor([0, *torch.tensor(padded, dtype=torch.long).cumsum(0).tolist()], dtype=torch.int32)


@given(layouts())
def test_index_maps_match_the_loop(layout):
    cp, padded = layout
    cu, local = _cu(padded), sum(padded) // cp
    shards = [_local_positions(padded, cp, r) for r in range(cp)]
    gathered = torch.tensor(shards, dtype=torch.long).reshape(cp, local)  # each slot holds its global position
    assert zigzag_to_global(gathered, cu).tolist() == list(range(sum(padded)))
    flat = gathered.flatten()
    assert flat[_zigzag_global_index(cu, cp, local)].tolist() == list(range(sum(padded)))


@given(layouts())
def test_plan_key_prefixes_match_the_loop(layout):
    cp, padded = layout
    cu, local = _cu(padded), sum(padded) // cp
    flat = torch.tensor([_local_positions(padded, cp, r) for r in range(cp)], dtype=torch.long).flatten()
    for r in range(cp):
        plan = plan_zigzag_attention(cu, max(padded), cp_size=cp, cp_rank=r, local_tokens=local)
        q_lens, keys, start = [], [], 0
        for p in padded:
            c = p // (2 * cp)
            for j in (r, 2 * cp - 1 - r):
                q_lens.append(c)
                keys += range(start, start + (j + 1) * c)  # the prefix ending with chunk j
            start += p
        assert plan.cu_seqlens_q.diff().tolist() == q_lens
        assert flat[plan.key_rows].tolist() == keys  # the rows hold exactly the prefix keys, in order
        assert plan.cu_seqlens_k[-1].item() == len(keys)
        assert plan.cu_seqlens_q.dtype == plan.cu_seqlens_k.dtype == torch.int32
        assert plan.max_seqlen_q >= max(q_lens) and plan.max_seqlen_k >= max(plan.cu_seqlens_k.diff().tolist())


def test_cp1_needs_no_group_and_matches_dense():
    case = Case("cp1", real=(3, 6), padded=(4, 6), hq=4, hkv=2)
    q, k, v, _ = _global_inputs(case, seed=7)
    out = context_parallel_attention(q, k, v, case.cu, 6, cp_size=1, cp_rank=0, cp_group=None,
                                     attn_fn=varlen_attention_reference)
    torch.testing.assert_close(out, _dense_causal(q, k, v, case.padded), **TOL)


def test_softmax_scale_is_passed_through():
    seen = {}

    def spy(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
        seen.update(causal=causal, scale=softmax_scale)
        return q

    q = k = v = torch.zeros(4, 2, 16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    context_parallel_attention(q, k, v, cu, 4, cp_size=1, cp_rank=0, cp_group=None, attn_fn=spy)
    assert seen == {"causal": True, "scale": 0.25}
    context_parallel_attention(q, k, v, cu, 4, cp_size=1, cp_rank=0, cp_group=None, attn_fn=spy, softmax_scale=0.5)
    assert seen["scale"] == 0.5


@pytest.mark.parametrize(
    "change, exc, match",
    [
        (dict(q=torch.zeros(8, 3, 4)), ValueError, "multiple of hkv"),
        (dict(k=torch.zeros(8, 1, 4)), ValueError, "v has"),  # v's head dim may differ (MLA), its heads not
        (dict(k=torch.zeros(8, 2, 5), v=torch.zeros(8, 2, 5)), ValueError, "share t_local"),
        (dict(q=torch.zeros(8, 4)), ValueError, "q must be"),
        (dict(cu=torch.tensor([0.0, 8.0])), ValueError, "cu_seqlens_padded"),
        (dict(max_seqlen=6), ValueError, "max_seqlen"),
        (dict(cp_rank=2), ValueError, "cp_rank"),
        (dict(cp_size=0), ValueError, "cp_size"),
        (dict(attn_fn=None), TypeError, "attn_fn"),
        (dict(q=torch.zeros(7, 4, 4), k=torch.zeros(7, 2, 4), v=torch.zeros(7, 2, 4)), ValueError, "odd"),
    ],
)
def test_bad_inputs(change, exc, match):
    args = dict(q=torch.zeros(8, 4, 4), k=torch.zeros(8, 2, 4), v=torch.zeros(8, 2, 4),
                cu=torch.tensor([0, 16], dtype=torch.int32), max_seqlen=16, cp_size=2, cp_rank=0,
                attn_fn=varlen_attention_reference)
    args.update(change)
    with pytest.raises(exc, match=match):
        context_parallel_attention(args["q"], args["k"], args["v"], args["cu"], args["max_seqlen"],
                                   cp_size=args["cp_size"], cp_rank=args["cp_rank"], cp_group=None,
                                   attn_fn=args["attn_fn"])


def test_without_process_group_cp2_is_refused():
    if dist.is_initialized():
        pytest.skip("an earlier test in this process initialised torch.distributed (a 1-process group)")
    q, k = torch.zeros(4, 2, 4), torch.zeros(4, 2, 4)
    with pytest.raises(ValueError, match="process group"):
        context_parallel_attention(q, k, k, torch.tensor([0, 8], dtype=torch.int32), 8, cp_size=2, cp_rank=0,
                                   cp_group=None, attn_fn=varlen_attention_reference)


# ------------------------------------------------------------------------------------ GPU (NCCL) tests
# Run on a machine with >= 2 GPUs: pytest -q tests/test_context_parallel.py -k cuda
# They cover what gloo cannot: NCCL's all_gather_single / reduce_scatter_single path of all_gather_cp, and a
# real flash kernel as attn_fn (its bottom-right causal alignment is what makes the key prefixes right).

GPU_CASE = Case("gpu_ragged_gqa", real=(37, 3, 64), padded=(40, 4, 64), hq=8, hkv=2, d=64)


def _cp_worker_cuda(rank: int, cp: int, case: Case):
    from packfwd.models.mixers.varlen import varlen_attention

    device = torch.device("cuda", rank)
    pos = torch.tensor(_local_positions(list(case.padded), cp, rank), dtype=torch.long)
    q, k, v, grad_out = _global_inputs(case, seed=0)
    results = {}
    for mode, dtype, attn_fn in (
        ("float64_reference", torch.float64, varlen_attention_reference),
        ("bf16_flash", torch.bfloat16, varlen_attention),  # picks flash_attn or torch_varlen for bf16 on CUDA
    ):
        ql, kl, vl = (x[pos].to(device, dtype).requires_grad_(True) for x in (q, k, v))
        out = context_parallel_attention(ql, kl, vl, case.cu.to(device), max(case.padded), cp_size=cp,
                                         cp_rank=rank, cp_group=None, attn_fn=attn_fn)
        (out * grad_out[pos].to(device, dtype)).sum().backward()
        results[mode] = [t.detach().double().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]
    return results


@functools.lru_cache(maxsize=None)
def _run_cuda(cp: int) -> list:
    return run_local(_cp_worker_cuda, cp, GPU_CASE, backend="nccl", timeout=300)


def _rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs (NCCL)")
@pytest.mark.parametrize("mode, rel_tol", [("float64_reference", 1e-10), ("bf16_flash", 2e-2)])
def test_cuda_nccl_matches_single_process(mode, rel_tol):
    cp, case = 2, GPU_CASE
    per_rank = _run_cuda(cp)
    q, k, v, grad_out = _global_inputs(case, seed=0)
    if mode == "bf16_flash":  # the oracle sees the same rounded inputs
        q, k, v, grad_out = (x.bfloat16().double() for x in (q, k, v, grad_out))
    q, k, v = (x.clone().requires_grad_(True) for x in (q, k, v))
    expected = _dense_causal(q, k, v, case.padded)
    (expected * grad_out).sum().backward()
    grads = [torch.zeros_like(x) for x in (q, k, v)]
    for rank, results in enumerate(per_rank):
        out, *local_grads = results[mode]
        pos = torch.tensor(_local_positions(list(case.padded), cp, rank), dtype=torch.long)
        assert _rel_err(out, expected.detach()[pos]) < rel_tol, f"{mode}: output of rank {rank}"
        for g, lg in zip(grads, local_grads):
            g[pos] = lg
    for name, g, ref in zip("qkv", grads, (q.grad, k.grad, v.grad)):
        assert _rel_err(g, ref) < rel_tol, f"{mode}: grad of {name}"
