"""The checks of tests/test_distributed.py on 2 GPUs with NCCL: TP=2, TP=2+SP, CP=2, PP=2 (and PP=2 x VPP=2),
in bf16 and float32; and Megatron-Core's own pipeline schedules running packfwd's stages.

Run on a machine with 2 CUDA devices (skipped otherwise), from the repository root:

    PYTHONPATH=. python -m pytest -q tests/gpu/test_distributed_nccl.py

Strategy: as in tests/test_distributed.py (same model, batch, loss and merging of the ranks' shards), with the
ranks on ``cuda:0`` and ``cuda:1`` joined by NCCL (``run_local(..., backend="nccl")``) and the references computed
in this process on ``cuda:0``: the single-GPU model in the same dtype, and in float32.  In bf16 the attention
backend is ``torch_varlen`` (PyTorch's flash kernel); in float32 it is packfwd's reference kernel.

Errors are relative: ``|got - want| / |want|`` (Frobenius norms) over the real tokens for the outputs, and for
each parameter's gradient (the worst parameter counts).  Tolerances:

* float32 vs the single-GPU float32 model: outputs 1e-4, gradients 1e-3 (only sums are reassociated);
* bf16 vs the single-GPU bf16 model: logits 0.05, log-probs and entropies 0.02, gradients 0.12;
* bf16 vs the single-GPU float32 model: logits 0.06, log-probs and entropies 0.02, gradients 0.15.

The bf16 bounds are about three times the errors the same comparisons give on the CPU (gloo, reference
attention): at most 0.019 (logits), 0.0044 (log-probs), 0.053 (the worst gradient, a QKV bias) against float32.
A layout error (a wrong shard, a double-counted CP gradient) gives errors of order 1.

Megatron-Core's schedules (``get_forward_backward_func``: 1F1B for PP=2, interleaved for PP=2 x VPP=2) need
CUDA, so they are checked here only: in float32 they must give the same outputs and gradients as packfwd's
point-to-point schedule (``packfwd.parallel.pipeline_forward_backward``) and the single-GPU model.
"""

from __future__ import annotations

import functools

import pytest
import torch

from packfwd.testing import run_local
from packfwd.models.convert.hf import args_from_hf_config
from tests.test_distributed import (
    Layout,
    batch,
    loss_of,
    merge_grads,
    merge_outputs,
    microbatches,
    reference,
    result,
    run_layouts,
    setup_rank,
    tiny_hf,
)

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")

LAYOUTS = [
    Layout("tp2", tp=2),
    Layout("tp2_sp", tp=2, sp=True),
    Layout("cp2", cp=2),
    Layout("pp2", pp=2, microbatches=2),
    Layout("pp2_vpp2", pp=2, vpp=2, microbatches=2),
]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}

# (reference dtype, distributed dtype) -> tolerances on relative errors
TOLERANCES = {
    ("fp32", "fp32"): {"logits": 1e-4, "log_probs": 1e-4, "entropy": 1e-4, "grads": 1e-3},
    ("bf16", "bf16"): {"logits": 0.05, "log_probs": 0.02, "entropy": 0.02, "grads": 0.12},
    ("fp32", "bf16"): {"logits": 0.06, "log_probs": 0.02, "entropy": 0.02, "grads": 0.15},
}
# How closely copies that every TP/CP rank computes from the same all-reduced values must agree.
REPLICA_TOL = {"fp32": 1e-5, "bf16": 2e-2}


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm().clamp_min(1e-30))


@functools.lru_cache(maxsize=None)
def nccl_run(dtype: str) -> dict:
    per_rank = run_local(run_layouts, 2, tiny_hf(), LAYOUTS, "cuda", DTYPES[dtype], backend="nccl", timeout=600)
    return {layout.name: [r[layout.name] for r in per_rank] for layout in LAYOUTS}


@functools.lru_cache(maxsize=None)
def merged(dtype: str, layout_name: str):
    layout = next(x for x in LAYOUTS if x.name == layout_name)
    per_rank = nccl_run(dtype)[layout_name]
    args = args_from_hf_config(tiny_hf().config)
    return (merge_outputs(layout, per_rank, REPLICA_TOL[dtype]),
            merge_grads(layout, per_rank, args, REPLICA_TOL[dtype]))


def check_against(got_out, got_grads, want_out, want_grads, tol: dict, what: str) -> None:
    _, mask, _, _ = batch()
    for k in ("logits", "log_probs", "entropy"):
        err = rel_err(got_out[k][mask], want_out[k][mask])
        assert err < tol[k], f"{what}: relative error of {k} is {err:.3g} (tolerance {tol[k]})"
        assert not got_out[k][~mask].any(), f"{what}: {k} must be zero at padding"
    assert sorted(got_grads) == sorted(want_grads)
    errors = {n: rel_err(got_grads[n], g) for n, g in want_grads.items()}
    worst = max(errors, key=errors.get)
    assert errors[worst] < tol["grads"], (
        f"{what}: relative error of the gradient of {worst} is {errors[worst]:.3g} (tolerance {tol['grads']})"
    )


@pytest.mark.parametrize("ref_dtype, dtype", list(TOLERANCES), ids=lambda x: x)
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: layout.name)
def test_matches_the_single_gpu_model(layout, ref_dtype, dtype):
    got_out, got_grads = merged(dtype, layout.name)
    want_out, want_grads = reference("cuda", DTYPES[ref_dtype])
    check_against(got_out, got_grads, want_out, want_grads, TOLERANCES[(ref_dtype, dtype)],
                  f"{layout.name} in {dtype} vs the single-GPU model in {ref_dtype}")


# ------------------------------------------------------------------------------ Megatron-Core's schedules


def megatron_schedule(rank: int, world_size: int, hf, layouts):
    """Each pipeline layout through ``megatron.core.pipeline_parallel.get_forward_backward_func()`` (float32)."""
    return {layout.name: _megatron_schedule(hf, layout) for layout in layouts}


def _megatron_schedule(hf, layout: Layout):
    from megatron.core.pipeline_parallel import get_forward_backward_func

    rank = setup_rank(hf, layout, "cuda", torch.float32)
    for stage in rank.stages:
        stage.config.variable_seq_lengths = True  # packed lengths differ between microbatches: send shapes
        stage.config.calculate_per_token_loss = True  # the loss as returned, not divided by the microbatch count
    mbs = microbatches(layout, rank.device)

    def forward_step(data_iterator, model):
        ids, mask, labels, weights = next(data_iterator)
        out = rank.forward(model, ids, mask, labels=labels)

        def loss_func(output):
            loss = loss_of(output, weights, mask)
            count = torch.ones((), dtype=torch.int, device=loss.device)
            return loss, count, {k: v.detach() for k, v in output.items()}

        return out, loss_func

    data = [iter(mbs) for _ in rank.stages]
    stored = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=data if layout.vpp > 1 else data[0],
        model=rank.stages if layout.vpp > 1 else rank.stages[0], num_microbatches=len(mbs),
        seq_length=mbs[0][0].shape[1], micro_batch_size=1, forward_only=False,
    )
    outputs = {k: torch.cat([s[k] for s in stored]) for k in stored[0]} if stored else None
    return result(rank, outputs)


@functools.lru_cache(maxsize=None)
def megatron_run() -> dict:
    layouts = [x for x in LAYOUTS if x.pp > 1]
    per_rank = run_local(megatron_schedule, 2, tiny_hf(), layouts, backend="nccl", timeout=600)
    return {layout.name: [r[layout.name] for r in per_rank] for layout in layouts}


@pytest.mark.parametrize("layout", [x for x in LAYOUTS if x.pp > 1], ids=lambda layout: layout.name)
def test_megatron_schedules_run_packfwd_stages(layout):
    per_rank = megatron_run()[layout.name]
    args = args_from_hf_config(tiny_hf().config)
    got_out, got_grads = merge_outputs(layout, per_rank), merge_grads(layout, per_rank, args)
    tol = TOLERANCES[("fp32", "fp32")]
    check_against(got_out, got_grads, *reference("cuda", torch.float32), tol,
                  f"{layout.name} through Megatron-Core's schedule vs the single-GPU model")
    check_against(got_out, got_grads, *merged("fp32", layout.name), tol,
                  f"{layout.name}: Megatron-Core's schedule vs packfwd's")
