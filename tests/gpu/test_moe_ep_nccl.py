"""Expert parallelism on 2 GPUs over NCCL: EP=2, each rank half the experts and a batch of its own shape.

Run on a machine with 2 CUDA devices (skipped otherwise), from the repository root:

    PYTHONPATH=. python -m pytest -q tests/gpu/test_moe_ep_nccl.py

Strategy: the CPU test (``tests/test_moe_ep.py``, gloo, float64) checks the exchange exactly; here the same exchange
runs through NCCL on CUDA, with the experts as the GPU runs them: in float32 Megatron-Core's sequential loop, in
bf16 packfwd's grouped GEMMs (``torch._grouped_mm``, sm90 / sm100).  A tiny Qwen3-MoE (hidden 128, 8 experts
top-2, expert ffn 64, a dense layer among two MoE ones) from transformers' weights; rank 0 runs a ``[4, 40]``
ragged batch, rank 1 a ``[3, 17]`` one.  The reference is the one-GPU model (``cuda:0``, the same dtype) on each
batch: its logits, its experts' load over both batches, its gradients of the loss summed over both batches.

* float32: logits and expert gradients within 1e-5 / 1e-4 relative; each rank's experts handed exactly the one-GPU
  load (routing is per token, and in float32 no top-k choice is near enough a tie to flip).
* bf16: the grouped path ran (each rank's MoE layers called it), logits within 0.05 relative of the one-GPU bf16
  model, expert gradients within 0.12; the load counts every real token ``top_k`` times per MoE layer, no pad (a
  bf16 top-k choice may flip between two GEMM shapes, so the split between experts is not compared).

``PACKFWD_EP_TEST_GLOO=1`` runs the same test on the CPU over gloo (float32 only), to check the test itself.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import from_hf

GLOO = os.environ.get("PACKFWD_EP_TEST_GLOO") == "1"
pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2 and not GLOO,
                                reason="needs 2 CUDA devices (NCCL); PACKFWD_EP_TEST_GLOO=1 runs it on the CPU")

V = 256
TOL = {"fp32": {"logits": 1e-5, "grads": 1e-4}, "bf16": {"logits": 0.05, "grads": 0.12}}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def hf_model():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.test_moe import randomise

    config = Qwen3MoeConfig(hidden_size=128, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=32, vocab_size=V, intermediate_size=192, moe_intermediate_size=64,
                            num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                            experts_implementation="eager")
    return randomise(Qwen3MoeForCausalLM(config), seed=3).float()


def batches():
    """Two batches of their own shapes: [4, 40] (lengths 40, 23 left-padded, 1, 31) and [3, 17] (17, 9, 12)."""
    out = []
    for seed, lengths, width in ((0, (40, 23, 1, 31), 40), (1, (17, 9, 12), 17)):
        g = torch.Generator().manual_seed(seed)
        mask = torch.zeros(len(lengths), width, dtype=torch.bool)
        for row, n in enumerate(lengths):
            if row == 1:
                mask[row, width - n:] = True  # left-padded
            else:
                mask[row, :n] = True
        out.append((torch.randint(1, V, mask.shape, generator=g).masked_fill(~mask, 0), mask))
    return out


def loss_of(logits, rank: int):
    g = torch.Generator().manual_seed(100 + rank)
    return (logits.float() * torch.randn(logits.shape, generator=g).to(logits.device)).sum()


def device_of() -> torch.device:
    return torch.device("cpu") if GLOO else torch.device("cuda", torch.cuda.current_device())


def counted(model, forward, ids, mask):
    """``(logits, load [moe layers, local experts], grouped calls)`` of one forward; ``grouped calls``: how many MoE
    layers ran packfwd's grouped GEMMs."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    from packfwd.models import experts as experts_module

    loads, calls = [], []
    hooks = [m.register_forward_pre_hook(lambda m, a: loads.append(a[1].detach().cpu().clone()))
             for m in model.modules() if isinstance(m, SequentialMLP)]
    original = experts_module.grouped_swiglu_mlp

    def spy(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    experts_module.grouped_swiglu_mlp = spy
    try:
        logits = forward(model, ids, mask)
    finally:
        experts_module.grouped_swiglu_mlp = original
        for h in hooks:
            h.remove()
    return logits, torch.stack(loads), len(calls)


def _ep_worker(rank: int, world: int, hf, data, dtype: str):
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(ep_size=2)
    device = device_of()
    model = from_hf(hf, ep_size=2, ep_rank=rank, device=device, params_dtype=DTYPES[dtype])
    ids, mask = (x.to(device) for x in data[rank])
    logits, load, calls = counted(model, make_forward("thd"), ids, mask)
    with host_collectives() if GLOO else torch.enable_grad():
        loss_of(logits, rank).backward()
    grads = {}
    for name, p in model.named_parameters():
        if ".local_experts." not in name:
            dist.all_reduce(p.grad, group=ps.get_data_parallel_group())
        grads[name] = p.grad.detach().cpu().clone()
    ps.destroy_model_parallel()
    return dict(logits=logits.detach().cpu(), load=load, calls=calls, grads=grads)


def rel(got, want) -> float:
    got, want = got.double(), want.double()
    return float((got - want).norm() / want.norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def reference(dtype: str):
    """The one-device model: logits of each batch, load over both, gradients of the summed loss."""
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    device = torch.device("cpu") if GLOO else torch.device("cuda", 0)
    model = from_hf(hf_model(), device=device, params_dtype=DTYPES[dtype])
    logits, load, total = [], 0, 0
    for rank, (ids, mask) in enumerate(batches()):
        out, lo, _ = counted(model, make_forward("thd"), ids.to(device), mask.to(device))
        logits.append(out.detach().cpu())
        load = load + lo
        total = total + loss_of(out, rank)
    total.backward()
    return logits, load, {n: p.grad.detach().cpu() for n, p in model.named_parameters()}


@pytest.mark.parametrize("dtype", ["fp32"] if GLOO else ["fp32", "bf16"])
def test_ep2_over_nccl_equals_one_gpu(dtype):
    from packfwd.models.mlp.moe_weights import expert_shard
    from packfwd.testing import run_local

    data = batches()
    want_logits, want_load, want_grads = reference(dtype)
    ranks = run_local(_ep_worker, 2, hf_model(), data, dtype, backend="gloo" if GLOO else "nccl", timeout=600)
    tol = TOL[dtype]
    moe_layers, top_k = 2, 2
    for rank, ((ids, mask), got) in enumerate(zip(data, ranks)):
        real = mask[..., None].expand_as(got["logits"])
        assert rel(got["logits"][real], want_logits[rank][real]) < tol["logits"], f"rank {rank} logits"
        mine = expert_shard(want_grads, 8, ep_size=2, ep_rank=rank)
        assert sorted(got["grads"]) == sorted(mine)
        worst = max(rel(got["grads"][n], g) for n, g in mine.items() if ".local_experts." in n)
        assert worst < tol["grads"], f"rank {rank} expert gradients {worst}"
        if dtype == "bf16":
            assert got["calls"] == moe_layers, f"rank {rank}: the grouped experts ran in {got['calls']} layers"
    load = torch.cat([r["load"] for r in ranks], dim=-1)
    assert load.sum() == moe_layers * top_k * sum(int(m.sum()) for _, m in data)  # every real token, no pad
    if dtype == "fp32":
        assert torch.equal(load, want_load)
