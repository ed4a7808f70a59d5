"""packfwd's experts (:class:`packfwd.models.mlp.experts.GroupedExperts`) against Megatron-Core's ``SequentialMLP``.

Strategy: the same weights in both modules, the same dispatched tokens (ragged groups, empty experts, no tokens
at all).  On the CPU the default path is Megatron-Core's own loop, so it equals ``SequentialMLP`` bit for bit in
float64 and float32, outputs and every gradient; the grouped path (``grouped=True``: torch's ``_grouped_mm``,
which loops over the groups itself on the CPU) equals it too in float32 and within bf16 rounding in bf16.  A
whole Qwen3-MoE model on the grouped path equals transformers per sequence, under TP=2 (+SP) and EP=2 over gloo
it equals the sequential path on each rank, and the state dict is ``SequentialMLP``'s, name for name.  The weights
are read in place (nothing stacked is kept for backward where they are not one block), and an empty expert's
weight gradient is zero whatever the grouped product leaves there.  The GPU kernel path is tested in
``tests/gpu/test_moe_cuda.py``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from packfwd.forward import make_forward
from packfwd.models import from_hf
from packfwd.models.mlp.experts import GroupedExperts, _block_view, grouped_kernel, set_grouped_experts
from tests.oracles import assert_equals_hf_per_sequence
from tests.test_moe import hf_model, ragged_batch

E, H, FFN = 4, 16, 8
GROUPS = {"ragged": [3, 0, 5, 1], "one expert": [0, 0, 9, 0], "no tokens": [0, 0, 0, 0]}


def experts_pair(dtype, grouped=None, device="cpu", experts=E, hidden=H, ffn=FFN, **config):
    """(GroupedExperts, SequentialMLP) of ``experts`` experts on ``device`` with the same weights (Megatron's
    initialisation)."""
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer.mlp import MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packfwd.models.runtime.cpu import ensure_cuda_rng_tracker
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    if device != "cpu":
        ensure_cuda_rng_tracker()
    fields = dict(num_layers=1, hidden_size=hidden, ffn_hidden_size=ffn, moe_ffn_hidden_size=ffn,
                  num_attention_heads=1, num_moe_experts=experts, moe_router_topk=2,
                  moe_router_load_balancing_type="none", gated_linear_unit=True, activation_func=F.silu,
                  add_bias_linear=False, bias_activation_fusion=False, params_dtype=dtype,
                  use_cpu_initialization=device == "cpu")
    config = TransformerConfig(**{**fields, **config})
    pg = ProcessGroupCollection.use_mpu_process_groups()
    linears = MLPSubmodules(linear_fc1=ColumnParallelLinear, linear_fc2=RowParallelLinear)
    torch.manual_seed(0)
    mine = GroupedExperts(experts, config, linears, pg, grouped=grouped)
    theirs = SequentialMLP(experts, config, linears, pg)
    theirs.load_state_dict(mine.state_dict())
    return mine, theirs


def run(module, x, counts, probs, grad):
    """Output and the gradients of x, probs and every weight, for ``sum(out * grad)``; ``counts`` a list (given
    as Megatron-Core's dispatcher does: a CPU tensor) or a tensor."""
    x, probs = x.clone().requires_grad_(), probs.clone().requires_grad_()
    module.zero_grad(set_to_none=True)
    out, bias = module(x, counts if isinstance(counts, torch.Tensor) else torch.tensor(counts), probs)
    assert bias is None
    (out * grad).sum().backward()
    grads = {n: p.grad for n, p in module.named_parameters()}
    return out.detach(), x.grad, probs.grad, grads


def dispatched(counts, dtype, seed=1, hidden=H, device="cpu"):
    """Tokens x [n, hidden], float32 probs [n] (as Megatron's router gives them) and an output gradient."""
    g = torch.Generator().manual_seed(seed)
    n = sum(counts)
    x = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    probs = torch.rand(n, generator=g, dtype=torch.float64).float()
    grad = torch.randn(n, hidden, generator=g, dtype=torch.float64)
    return x.to(device, dtype), probs.to(device), grad.to(device, dtype)


def assert_same(got, want, atol=0.0, rtol=0.0):
    """Outputs and gradients equal (bit for bit by default)."""
    assert sorted(got[3]) == sorted(want[3])
    for a, b in [*zip(got[:3], want[:3]), *((got[3][n], want[3][n]) for n in want[3])]:
        torch.testing.assert_close(a, b, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_default_path_on_the_cpu_is_sequential_mlp_bitwise(dtype, groups):
    mine, theirs = experts_pair(dtype)
    data = dispatched(GROUPS[groups], dtype)
    assert not grouped_kernel(data[0])
    assert_same(run(mine, data[0], GROUPS[groups], *data[1:]), run(theirs, data[0], GROUPS[groups], *data[1:]))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, {}), (torch.bfloat16, dict(atol=3e-2, rtol=2e-2))])
@pytest.mark.parametrize("groups", sorted(GROUPS))
def test_grouped_path_equals_sequential_mlp(dtype, tol, groups, monkeypatch):
    """float32: bit for bit (torch's CPU grouped matmul and Megatron's linears make the same products); bf16:
    within rounding (packfwd's SwiGLU rounds once, Megatron's unfused one twice)."""
    mine, theirs = experts_pair(dtype, grouped=True)
    counts = GROUPS[groups]
    x, probs, grad = dispatched(counts, dtype)
    used, original = [], torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: used.append(1) or original(*a, **k))
    got = run(mine, x, counts, probs, grad)
    assert len(used) == (0 if sum(counts) == 0 else 6)  # fc1, fc2; backward dx, dW each (none without tokens)
    assert_same(got, run(theirs, x, counts, probs, grad), **tol)


def test_an_empty_experts_weight_gradient_is_zero_whatever_the_grouped_product_leaves(monkeypatch):
    """The weight gradient of an expert without tokens is a grouped product over zero rows (``K = 0``): the grouped
    path sets it to zero itself rather than trust the kernel to write it (here it writes NaN)."""
    mine, theirs = experts_pair(torch.float32, grouped=True)
    counts = GROUPS["ragged"]
    x, probs, grad = dispatched(counts, torch.float32)
    original = torch._grouped_mm

    def unwritten(a, b, offs=None, **kw):
        out = original(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 2:  # the weight gradient: [E, out, in] over groups along K
            sizes = torch.diff(offs, prepend=offs.new_zeros(1))
            out[sizes == 0] = float("nan")
        return out

    monkeypatch.setattr(torch, "_grouped_mm", unwritten)
    got = run(mine, x, counts, probs, grad)
    assert torch.equal(got[3]["local_experts.1.linear_fc1.weight"], torch.zeros(2 * FFN, H))
    assert_same(got, run(theirs, x, counts, probs, grad))


def test_state_dict_is_sequential_mlps_name_for_name():
    mine, theirs = experts_pair(torch.float32)
    a, b = mine.state_dict(), theirs.state_dict()
    assert list(a) == list(b) and all(a[k].shape == b[k].shape for k in a if isinstance(a[k], torch.Tensor))
    assert "local_experts.3.linear_fc1.weight" in a and a["local_experts.3.linear_fc1.weight"].shape == (2 * FFN, H)
    assert a["local_experts.0.linear_fc2.weight"].shape == (H, FFN)


def test_weights_are_read_in_place_and_a_relocated_parameter_is_stacked():
    """The constructor lays each linear's expert weights in one block: the grouped path reads it without a copy
    (and each weight gets its own gradient); a parameter moved elsewhere is stacked instead (a transient copy, not
    saved for backward), same numbers."""
    mine, theirs = experts_pair(torch.float32, grouped=True)
    fc1 = [e.linear_fc1.weight for e in mine.local_experts]
    block = _block_view(fc1)
    assert block is not None and block.data_ptr() == fc1[0].data_ptr() and torch.equal(block[2], fc1[2])
    counts, (x, probs, grad) = GROUPS["ragged"], dispatched(GROUPS["ragged"], torch.float32)
    want = run(theirs, x, counts, probs, grad)
    assert_same(run(mine, x, counts, probs, grad), want)
    mine.local_experts[1].linear_fc1.weight.data = fc1[1].data.clone()  # no longer one block
    assert _block_view(fc1) is None
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
        got = run(mine, x, counts, probs, grad)
    assert_same(got, want)
    assert (E, 2 * FFN, H) not in saved and (E, H, 2 * FFN) not in saved  # the stacked copy is not kept for backward


def test_choices_and_refusals():
    mine, _ = experts_pair(torch.float64)
    assert mine.grouped is None
    with pytest.raises(TypeError, match="grouped='yes'"):
        mine.grouped = "yes"
    mine.grouped = True
    x, probs, _ = dispatched([2, 1, 0, 1], torch.float64)
    with pytest.raises(ValueError, match="torch._grouped_mm takes"):
        mine(x, torch.tensor([2, 1, 0, 1]), probs)
    fp32, _ = experts_pair(torch.float32, grouped=True)
    x, probs, _ = dispatched([2, 1, 0, 1], torch.float32)
    with pytest.raises(ValueError, match="sums to 5 but x has 4 rows"):
        fp32(x, torch.tensor([2, 1, 1, 1]), probs)
    with pytest.raises(ValueError, match="are not a gated linear unit"):
        experts_pair(torch.float32, grouped=True, gated_linear_unit=False)
    plain, _ = experts_pair(torch.float32, gated_linear_unit=False)  # automatic: the sequential path computes it
    with torch.no_grad():
        out = plain(x, torch.tensor([2, 1, 0, 1]), probs)[0]
    assert plain.unsupported == "are not a gated linear unit" and out.shape == x.shape
    # biased experts and GPT-OSS's clamped GLU: grouped_glu_mlp (tests/test_gpt_oss.py)
    assert experts_pair(torch.float32, grouped=True, add_bias_linear=True)[0].unsupported == ""



@pytest.mark.parametrize("value", [0, 1, np.False_, np.True_])
def test_a_flag_that_is_not_a_bool_is_refused(value):
    """``0 in (None, True, False)`` holds (``0 == False``), and the path was chosen by ``is False``: ``grouped=0``
    (an int flag from a config) took the grouped path, the opposite of what it says.  Refused, naming it."""
    mine, _ = experts_pair(torch.float32)
    with pytest.raises(TypeError, match=f"grouped={value!r}: pass None"):
        mine.grouped = value
    with pytest.raises(TypeError, match=f"grouped={value!r}: pass None"):
        set_grouped_experts(mine, value)
    assert mine.grouped is None


@pytest.mark.parametrize("grouped", [False, True])
def test_functional_call_with_other_expert_weights_equals_loading_them(grouped):
    """``torch.func.functional_call`` on an MoE model (the grouped path reads the experts' weights as one block,
    and stacks weights that are not one): a params dict with other expert and router weights gives the outputs of
    a model holding them, and its tensors get that model's gradients."""
    from packfwd.models.convert.hf import load_weights
    from tests.test_models import _Functional

    hf = hf_model("qwen3_moe-norm")
    model, loaded = from_hf(hf, params_dtype=torch.float32), from_hf(hf, params_dtype=torch.float32)
    set_grouped_experts(model, grouped)
    set_grouped_experts(loaded, grouped)
    params = {n: (p.detach() * 1.3 if "experts" in n or "router" in n else p.detach()).clone().requires_grad_()
              for n, p in model.named_parameters()}
    load_weights(loaded, {n: v.detach() for n, v in params.items()})
    ids, mask = ragged_batch()
    forward = make_forward("thd", seq_align=8)
    got, want = forward(_Functional(model, params), ids, mask), forward(loaded, ids, mask)
    assert not torch.allclose(want, forward(model, ids, mask))
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    got.pow(2).mean().backward()
    want.pow(2).mean().backward()
    for name, p in loaded.named_parameters():
        torch.testing.assert_close(params[name].grad, p.grad, atol=0, rtol=0, msg=name)
    assert all(p.grad is None for p in model.parameters())

def test_models_are_built_with_grouped_experts_and_match_transformers_per_sequence():
    hf = hf_model("qwen3_moe-norm").float()
    model = from_hf(hf)
    assert set_grouped_experts(model, True) == 2  # layers 0 and 2 are MoE, layer 1 dense
    ids, mask = ragged_batch()
    with torch.no_grad():
        grouped = make_forward("thd", seq_align=8)(model, ids, mask)
        assert_equals_hf_per_sequence(hf, grouped, ids, mask, atol=1e-4, rtol=1e-4)
        set_grouped_experts(model, False)
        torch.testing.assert_close(grouped, make_forward("thd", seq_align=8)(model, ids, mask), atol=0, rtol=0)


def _parallel_worker(rank: int, world: int, hf, layouts):
    """Per layout ``(name, tp, ep)``: this rank's logits and gradients on the grouped and the sequential path."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.runtime import ensure_model_parallel

    results = {}
    for name, tp, ep in layouts:
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ensure_model_parallel(tp_size=tp, ep_size=ep)
        model = from_hf(hf, tp_size=tp, ep_size=ep, sequence_parallel=tp > 1)  # Megatron: MoE + TP needs SP
        ids, mask = ragged_batch(seed=rank if ep > 1 else 0)  # EP ranks: batches of their own
        for grouped in (True, False):
            set_grouped_experts(model, grouped)
            model.zero_grad(set_to_none=True)
            logits = make_forward("thd", tp_size=tp)(model, ids, mask)
            with host_collectives():
                (logits * logits.detach()).sum().backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters() if ".local_experts." in n}
            results[(name, grouped)] = dict(logits=logits.detach(), grads=grads)
    ps.destroy_model_parallel()
    return results


def test_tp2_and_ep2_over_gloo_grouped_equals_sequential():
    """Under TP=2 (+SP) each rank's experts are its shards along f, under EP=2 half the experts: the grouped path gives
    each rank the sequential path's logits and expert gradients."""
    from packfwd.testing import run_local

    hf = hf_model("qwen3_moe-norm").float()
    ranks = run_local(_parallel_worker, 2, hf, [("tp2", 2, 1), ("ep2", 1, 2)], backend="gloo", timeout=300)
    for rank in ranks:
        for layout in ("tp2", "ep2"):
            got, want = rank[(layout, True)], rank[(layout, False)]
            torch.testing.assert_close(got["logits"], want["logits"], atol=1e-6, rtol=1e-6)
            assert sorted(got["grads"]) == sorted(want["grads"]) and got["grads"]
            for name, grad in want["grads"].items():
                torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-5, msg=name)
