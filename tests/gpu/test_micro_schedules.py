"""Planned micro-batches through a real pipeline on two GPUs (NCCL): Megatron-Core's own schedule
(``run_micro_batches(..., schedule="megatron")``, 1F1B with variable sequence lengths) against packfwd's
point-to-point schedule on the same stages and batch, and both against one forward/backward of the whole batch on
the CPU (``tests/test_micro_batches.py::reference``).

Run on a machine with 2 CUDA devices (skipped otherwise): ``python -m pytest -q tests/gpu/test_micro_schedules.py``.
Tolerances (float32): the two schedules on the same GPU kernels, ``atol=1e-6``; GPU against the CPU reference,
``atol=5e-5, rtol=1e-4`` (other kernels, other summation order).
"""

from __future__ import annotations

import pytest
import torch

from packfwd.testing import run_local
from tests.test_micro_batches import SEQLENS, layout_step, per_token_loss, reference, step_batch, tiny_hf

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices (NCCL)")


def rank_step(rank: int, world_size: int, hf, schedules) -> dict:
    from megatron.core import parallel_state as ps

    import packfwd as pf
    from packfwd.layers import layer_partition
    from packfwd.logits import log_probs_and_entropy
    from packfwd.micro import plan_micro_batches, run_micro_batches
    from packfwd.models import from_hf
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(pp_size=world_size)
    first = layer_partition(hf.config.num_hidden_layers, world_size)[rank][0].start
    device = torch.device("cuda", torch.cuda.current_device())
    ids, mask, labels, loss_mask, adv = (x.to(device) for x in step_batch())
    plan = plan_micro_batches(SEQLENS, max_tokens=20, micro_batches_multiple_of=2)
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    results = {}
    for schedule in schedules:
        stage = from_hf(hf, pp_rank=rank, pp_size=world_size, device=device, attention_backend="reference")
        stage.config.variable_seq_lengths = True
        stage.config.calculate_per_token_loss = True
        out = run_micro_batches(forward, [stage], plan, ids, mask, dp_rank=0, schedule=schedule,
                                pp_group=ps.get_pipeline_model_parallel_group(), loss_fn=per_token_loss,
                                loss_mask=loss_mask, loss_args={"advantages": adv}, labels=labels)
        grads = {}
        for name, p in stage.named_parameters():
            if name.startswith("decoder.layers."):
                local, rest = name[len("decoder.layers."):].split(".", 1)
                name = f"decoder.layers.{int(local) + first}.{rest}"
            grads[name] = p.grad.detach().cpu()
        results[schedule] = dict(
            grads=grads,
            result=None if out is None else (out.loss.cpu(), {k: v.cpu() for k, v in out.outputs.items()}, out.rows),
        )
    ps.destroy_model_parallel()
    return results


def test_megatron_schedule_equals_packfwds_and_the_whole_batch():
    ref_out, ref_loss, ref_grads = reference("token_mean")
    ranks = run_local(rank_step, 2, tiny_hf(), ("packfwd", "megatron"), backend="nccl", timeout=600)
    same, ref = dict(atol=1e-6, rtol=1e-6), dict(atol=5e-5, rtol=1e-4)
    assert ranks[0]["megatron"]["result"] is None and ranks[1]["megatron"]["result"] is not None
    for rank in ranks:
        assert rank["megatron"]["grads"].keys() == rank["packfwd"]["grads"].keys()
        for name, g in rank["megatron"]["grads"].items():
            torch.testing.assert_close(g, rank["packfwd"]["grads"][name], **same, msg=name)
            torch.testing.assert_close(g, ref_grads[name], **ref, msg=name)
    loss, outputs, rows = ranks[1]["megatron"]["result"]
    torch.testing.assert_close(loss, ranks[1]["packfwd"]["result"][0], **same)
    torch.testing.assert_close(loss, ref_loss, **ref)
    for key, value in outputs.items():
        torch.testing.assert_close(value, ref_out[key][rows], **ref)


# ------------------------------------------------------- interleaved (VPP) and context parallel, Megatron's schedule


@pytest.mark.parametrize("pp, vpp, cp", [
    pytest.param(4, 2, 1, id="pp4_vpp2", marks=pytest.mark.skipif(torch.cuda.device_count() < 4, reason="4 GPUs")),
    pytest.param(1, 1, 2, id="cp2"),
])
def test_megatron_interleaved_and_cp_schedules_equal_the_whole_batch(pp, vpp, cp):
    """PP=4 x VPP=2 through Megatron-Core's interleaved 1F1B, and CP=2 through its no-pipelining schedule: equal to
    packfwd's schedule (1e-6) and to one forward/backward of the whole batch on the CPU (5e-5).  Under CP every rank
    computes the same loss from the gathered outputs and keeps its share of the gradient: the CP ranks' gradients
    add up to the whole batch's (what Megatron's data-and-context-parallel all-reduce does)."""
    layers, world = 2 * pp * vpp, pp * cp
    ref_out, ref_loss, ref_grads = reference("token_mean", layers=layers)
    ranks = run_local(layout_step, world, tiny_hf(layers=layers), pp, vpp, cp, "cuda", ("packfwd", "megatron"),
                      backend="nccl", timeout=600)
    same, ref = dict(atol=1e-6, rtol=1e-6), dict(atol=5e-5, rtol=1e-4)
    assert all(r["count"] >= 2 and r["count"] % pp == 0 for r in ranks)
    for rank in ranks:
        assert rank["megatron"]["grads"].keys() == rank["packfwd"]["grads"].keys()
        for name, g in rank["megatron"]["grads"].items():
            torch.testing.assert_close(g, rank["packfwd"]["grads"][name], **same, msg=name)
    if cp > 1:
        grads = {n: sum(r["megatron"]["grads"][n] for r in ranks) for n in ref_grads}
    else:
        grads = {k: v for r in ranks for k, v in r["megatron"]["grads"].items()}
    assert grads.keys() == ref_grads.keys(), set(grads) ^ set(ref_grads)
    for name, g in grads.items():
        torch.testing.assert_close(g, ref_grads[name], **ref, msg=name)
    last = [r for r in ranks if r["megatron"]["result"] is not None]
    assert len(last) == (cp if pp == 1 else 1)
    for r in last:
        loss, outputs, rows = r["megatron"]["result"]
        torch.testing.assert_close(loss, r["packfwd"]["result"][0], **same)
        torch.testing.assert_close(loss, ref_loss, **ref)
        for key, value in outputs.items():
            torch.testing.assert_close(value, ref_out[key][rows], **ref)
