"""packfwd's models split over real processes (gloo, CPU): TP, TP+SP (THD and BSHD), CP, CP x TP (+SP), PP,
PP x VPP.

Strategy: the reference is the single-process packfwd model built from the same HF weights (``from_hf``) in
this process and run with ``make_forward("thd")`` on the same ragged batch (that model is itself checked against
HF transformers, sequence by sequence, in test_hf_interop.py).  Every rank of a real ``run_local`` world builds
its own shard with ``from_hf(hf, tp_size=, tp_rank=, sequence_parallel=, pp_rank=, pp_size=, vpp_rank=,
vpp_size=)`` on Megatron-Core's parallel state, runs the same forward (its CP share under CP; the pipeline
schedule of packfwd.parallel.pipeline under PP, two microbatches) and backpropagates the same loss
``sum(w * (log_prob + 0.1 * entropy))`` over the real tokens (vocab-parallel log-probs under TP).  The ranks send
back their logits (their vocab slice), log-probs, entropies and parameter gradients by name; here they are put
together the way each kind of parallelism splits them:

* TP: logits concatenated over the vocab; gradient shards merged into HF names with ``megatron_to_hf`` (which
  ``test_hf_interop.test_tp_shards_by_hand`` checks head by head); norms are replicated, so without SP every TP
  rank must hold the full norm gradient, and with SP each holds its tokens' part and the parts are summed;
* CP: every CP rank must return the same gathered outputs, and its parameter gradients are its tokens' part:
  summed over the CP ranks they must equal the reference (not twice it: the gather must not double count);
* PP (x VPP): each stage contributes its own layers (``layer_partition``), the first the embedding, the last the
  final norm and output layer.

Tolerances (float32): outputs ``atol=2e-5, rtol=1e-4`` (the largest difference seen is 4.3e-6 on logits of
magnitude ~5: sums are only reassociated); gradients ``atol=5e-5, rtol=1e-4`` (largest seen 1.4e-5, on
gradients up to 12; a double-counted CP gradient is off by the whole gradient).

A second part checks failures: bad input on one rank makes every rank raise the same error (planning is agreed
over the group before any collective), and nothing hangs.

Each configuration group runs in one ``run_local`` call (process start and the Megatron import cost seconds); a
rank re-initialises Megatron's parallel state between configurations.
"""

from __future__ import annotations

import contextlib
import functools
import time
from dataclasses import dataclass

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from packfwd import next_token_labels
from packfwd.forward import make_forward
from packfwd.testing import RankError, run_local
from packfwd.layers import layer_partition
from packfwd.logits import log_probs_and_entropy
from packfwd.models import from_hf, megatron_to_hf
from packfwd.models.convert.hf import args_from_hf_config

from .test_hf_interop import TINY, randomise, ragged_batch

OUT_TOL = dict(atol=2e-5, rtol=1e-4)
GRAD_TOL = dict(atol=5e-5, rtol=1e-4)


@dataclass(frozen=True)
class Layout:
    name: str
    tp: int = 1
    cp: int = 1
    pp: int = 1
    vpp: int = 1
    sp: bool = False
    microbatches: int = 1
    data_format: str = "thd"

    @property
    def world(self) -> int:
        return self.tp * self.cp * self.pp


TWO_RANKS = [
    Layout("tp2", tp=2),
    Layout("tp2_sp", tp=2, sp=True),
    Layout("tp2_sp_bshd", tp=2, sp=True, data_format="bshd"),
    Layout("cp2", cp=2),
    Layout("pp2", pp=2, microbatches=2),
    Layout("pp2_vpp2", pp=2, vpp=2, microbatches=2),
]
FOUR_RANKS = [
    Layout("cp2_tp2", tp=2, cp=2),
    Layout("cp2_tp2_sp", tp=2, cp=2, sp=True),
]


# ------------------------------------------------------------------------------------------- model and data


def tiny_hf(seed: int = 0) -> Qwen2ForCausalLM:
    """Qwen2 (GQA 4 heads / 2 kv heads, QKV bias, untied), 4 layers so that PP=2 x VPP=2 has a layer per chunk."""
    config = Qwen2Config(**{**TINY, "num_hidden_layers": 4}, num_key_value_heads=2, rms_norm_eps=1e-5)
    return randomise(Qwen2ForCausalLM(config), seed)


def batch(device="cpu"):
    """Ragged ids [4, 12] (lengths 12, 7, 3, 9; right, left and holed padding), labels and loss weights."""
    ids, mask = ragged_batch("mixed")
    labels = next_token_labels(ids, mask)
    weights = torch.rand(ids.shape, generator=torch.Generator().manual_seed(5))
    return tuple(x.to(device) for x in (ids, mask, labels, weights))


def processor(logits, labels, *, tp_group=None):
    """Log-probs and entropies (vocab-parallel over ``tp_group``), and the logits themselves."""
    return {**log_probs_and_entropy(logits, labels, tp_group=tp_group), "logits": logits}


def loss_of(out, weights, mask):
    return ((out["log_probs"] + 0.1 * out["entropy"]) * weights * mask).sum()


# ------------------------------------------------------------------------------------------ the ranks' side


def run_layouts(rank: int, world_size: int, hf, layouts, device_type: str = "cpu", dtype=torch.float32):
    """Each layout in turn on this rank; returns ``{layout.name: result}`` (see :func:`_run_layout`)."""
    results = {}
    for layout in layouts:
        try:
            results[layout.name] = _run_layout(hf, layout, device_type, dtype)
        except Exception as exc:  # name the layout in the report run_local gives
            raise RuntimeError(f"layout {layout.name}: {type(exc).__name__}: {exc}") from exc
    return results


def _run_layout(hf, layout: Layout, device_type: str, dtype):
    """Forward and backward of this rank's shard on the batch; its outputs and gradients (see :func:`result`)."""
    from packfwd.models.runtime.cpu import host_collectives
    from packfwd.parallel import pipeline_forward_backward

    rank = setup_rank(hf, layout, device_type, dtype)
    current_device = torch.cuda.current_device  # host_collectives swaps it for a while, and must put it back
    if layout.pp == 1:
        ids, mask, labels, weights = batch(rank.device)
        out = rank.forward(rank.stages[0], ids, mask, labels=labels)
        with host_collectives() if rank.device.type == "cpu" else contextlib.nullcontext():
            loss_of(out, weights, mask).backward()
        assert torch.cuda.current_device is current_device
        return result(rank, {k: v.detach() for k, v in out.items()})
    outs = pipeline_forward_backward(
        rank.stages, lambda stage, mb: rank.forward(stage, mb[0], mb[1], labels=mb[2]),
        microbatches(layout, rank.device), pp_group=rank.pp_group, loss_fn=lambda o, mb: loss_of(o, mb[3], mb[1]),
    )
    assert torch.cuda.current_device is current_device
    return result(rank, None if outs is None else {k: torch.cat([o[k] for o in outs]) for k in outs[0]})


@dataclass
class RankSetup:
    stages: list  # this rank's model chunks, one per virtual stage
    forward: object  # make_forward's forward for this rank (TP, CP and SP arguments set)
    ranks: tuple[int, int, int]  # (tp_rank, cp_rank, pp_rank)
    device: torch.device
    pp_group: object


def setup_rank(hf, layout: Layout, device_type: str, dtype) -> RankSetup:
    """Megatron's parallel state for ``layout`` (re-initialised) and this rank's shard of ``hf``."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ensure_model_parallel(tp_size=layout.tp, cp_size=layout.cp, pp_size=layout.pp, vpp_size=layout.vpp)
    tp_rank, cp_rank = ps.get_tensor_model_parallel_rank(), ps.get_context_parallel_rank()
    pp_rank = ps.get_pipeline_model_parallel_rank()
    device = torch.device("cuda", torch.cuda.current_device()) if device_type == "cuda" else torch.device("cpu")
    stages = [
        from_hf(hf, tp_size=layout.tp, tp_rank=tp_rank, sequence_parallel=layout.sp, pp_rank=pp_rank,
                pp_size=layout.pp, vpp_rank=v, vpp_size=layout.vpp, device=device, params_dtype=dtype)
        for v in range(layout.vpp)
    ]
    tp_group = ps.get_tensor_model_parallel_group() if layout.tp > 1 else None
    cp_group = ps.get_context_parallel_group() if layout.cp > 1 else None
    forward = make_forward(layout.data_format, tp_size=layout.tp, cp_size=layout.cp, cp_rank=cp_rank,
                           cp_group=cp_group, logits_processor=functools.partial(processor, tp_group=tp_group))
    return RankSetup(stages, forward, (tp_rank, cp_rank, pp_rank), device, ps.get_pipeline_model_parallel_group())


def microbatches(layout: Layout, device) -> list[tuple]:
    """The batch cut into ``layout.microbatches`` groups of rows: (ids, mask, labels, weights) each."""
    ids, mask, labels, weights = batch(device)
    rows = torch.arange(ids.shape[0], device=device).chunk(layout.microbatches)
    return [(ids[r], mask[r], labels[r], weights[r]) for r in rows]


def result(rank: RankSetup, outputs: dict | None) -> dict:
    """What a rank sends back: its ranks, outputs (last stage only), gradients and SP-marked parameter names per
    chunk (float32, CPU).  Tears Megatron's parallel state down."""
    from megatron.core import parallel_state as ps

    grads = [{n: (p.grad if p.grad is not None else torch.zeros_like(p)).detach().float().cpu()
              for n, p in stage.named_parameters()} for stage in rank.stages]
    sp_names = [[n for n, p in stage.named_parameters() if getattr(p, "sequence_parallel", False)]
                for stage in rank.stages]
    ps.destroy_model_parallel()
    return {
        "ranks": rank.ranks,
        "outputs": None if outputs is None else {k: v.float().cpu() for k, v in outputs.items()},
        "grads": grads,
        "sp_names": sp_names,
    }


# ------------------------------------------------------------------------------------------ the test's side


@functools.lru_cache(maxsize=None)
def reference(device_type: str = "cpu", dtype=torch.float32):
    """The single-process model's outputs and its gradients in HF names."""
    hf = tiny_hf()
    model = from_hf(hf, device=device_type, params_dtype=dtype)
    ids, mask, labels, weights = batch(device_type)
    out = make_forward("thd", logits_processor=processor)(model, ids, mask, labels=labels)
    loss_of(out, weights, mask).backward()
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    hf_grads = megatron_to_hf([grads], args_from_hf_config(hf.config))
    return {k: v.detach().float().cpu() for k, v in out.items()}, hf_grads


@functools.lru_cache(maxsize=None)
def distributed(world: int):
    layouts = [layout for layout in TWO_RANKS + FOUR_RANKS if layout.world == world]
    per_rank = run_local(run_layouts, world, tiny_hf(), layouts, backend="gloo", timeout=300)
    return {layout.name: [r[layout.name] for r in per_rank] for layout in layouts}


def merge_outputs(layout: Layout, per_rank: list[dict], replica_tol: float = 1e-6) -> dict[str, torch.Tensor]:
    """The last stage's outputs: logits concatenated over the TP ranks' vocab slices; every CP rank's copy must be
    the same and every TP rank's log-probs must agree (to ``replica_tol``)."""
    last = [r for r in per_rank if r["ranks"][2] == layout.pp - 1]
    assert all(r["outputs"] is not None for r in last)
    assert all(r["outputs"] is None for r in per_rank if r not in last), "only the last pipeline stage has outputs"
    by_tp = {}
    for r in last:
        tp_rank, cp_rank, _ = r["ranks"]
        if tp_rank in by_tp:  # another CP rank: the gathered outputs are the same copies
            for k, v in r["outputs"].items():
                assert torch.equal(v, by_tp[tp_rank][k]), f"CP rank {cp_rank} has other {k}"
        else:
            by_tp[tp_rank] = r["outputs"]
    first = by_tp[0]
    for tp_rank, out in by_tp.items():
        for k in ("log_probs", "entropy"):
            torch.testing.assert_close(out[k], first[k], atol=replica_tol, rtol=replica_tol,
                                       msg=f"{k} of TP rank {tp_rank}")
    logits = torch.cat([by_tp[t]["logits"] for t in range(layout.tp)], dim=-1)
    return {"log_probs": first["log_probs"], "entropy": first["entropy"], "logits": logits}


def merge_grads(layout: Layout, per_rank: list[dict], args, replica_tol: float = 1e-6) -> dict[str, torch.Tensor]:
    """Gradients in HF names: CP parts summed, SP norm parts summed over TP, TP shards and PP stages merged.
    Without SP the norm gradients of every TP rank must agree (to ``replica_tol``, relative)."""
    partition = layer_partition(args.num_layers, layout.pp, layout.vpp)
    merged = {}
    for pp_rank in range(layout.pp):
        for v in range(layout.vpp):
            shards = []
            for tp_rank in range(layout.tp):
                parts = [r["grads"][v] for r in per_rank if r["ranks"][0] == tp_rank and r["ranks"][2] == pp_rank]
                assert len(parts) == layout.cp
                shards.append({n: sum(p[n] for p in parts) for n in parts[0]})
            stage_ranks = [r for r in per_rank if r["ranks"][2] == pp_rank]
            norms = [n for n in shards[0] if "layernorm" in n]
            if layout.sp:
                assert sorted(stage_ranks[0]["sp_names"][v]) == sorted(norms), "SP marks exactly the norms"
                for n in norms:
                    total = sum(s[n] for s in shards)
                    for s in shards:
                        s[n] = total
            else:
                for s in shards[1:]:  # replicated and computed from every token on each TP rank
                    for n in norms:
                        scale = float(shards[0][n].abs().max())
                        torch.testing.assert_close(s[n], shards[0][n], atol=replica_tol * scale, rtol=replica_tol)
            pre, post = pp_rank == 0 and v == 0, pp_rank == layout.pp - 1 and v == layout.vpp - 1
            merged.update(megatron_to_hf(shards, args, layers=partition[pp_rank][v], pre_process=pre,
                                         post_process=post))
    return merged


@pytest.mark.parametrize("layout", TWO_RANKS + FOUR_RANKS, ids=lambda layout: layout.name)
def test_matches_the_single_process_model(layout):
    per_rank = distributed(layout.world)[layout.name]
    want_out, want_grads = reference()
    ids, mask, _, _ = batch()
    got = merge_outputs(layout, per_rank)
    for k in ("logits", "log_probs", "entropy"):
        assert got[k].shape == want_out[k].shape, k
        torch.testing.assert_close(got[k][mask], want_out[k][mask], **OUT_TOL, msg=f"{layout.name}: {k}")
        assert not got[k][~mask].any(), f"{layout.name}: {k} must be zero at padding"
    grads = merge_grads(layout, per_rank, args_from_hf_config(tiny_hf().config))
    assert sorted(grads) == sorted(want_grads)
    for n, g in want_grads.items():
        torch.testing.assert_close(grads[n], g, **GRAD_TOL, msg=f"{layout.name}: grad of {n}")


# ------------------------------------------------------------------------------------------------- failures


def _cp_forward(hf, *, check: bool):
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(cp_size=2)
    group = ps.get_context_parallel_group()
    return from_hf(hf), make_forward("thd", cp_size=2, cp_rank=ps.get_context_parallel_rank(), cp_group=group,
                                     check_group=group if check else None, logits_processor=processor)


def bad_mask_on_rank_one(rank: int, world_size: int, hf):
    """CP=2 with the batch checked over the CP group; rank 1's mask lacks a column."""
    model, forward = _cp_forward(hf, check=True)
    ids, mask, labels, _ = batch()
    forward(model, ids, mask if rank == 0 else mask[:, :-1], labels=labels)
    return "no error"


def caught_failures(rank: int, world_size: int, hf):
    """Bad input of several kinds; returns what each case raised on this rank, as (type, message)."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.parallel import pipeline_forward_backward

    def attempt(fn):
        try:
            fn()
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return None

    seen = {}
    model, forward = _cp_forward(hf, check=True)
    ids, mask, labels, _ = batch()
    other = mask.clone()
    other[2, 0] = ~other[2, 0]  # rank 1's batch has one token more or less
    seen["different_batch"] = attempt(lambda: forward(model, ids, mask if rank == 0 else other, labels=labels))
    _, unchecked = _cp_forward(hf, check=False)  # the same bad labels everywhere, no check group
    seen["same_bad_labels"] = attempt(lambda: unchecked(model, ids, mask, labels=labels[:, :-1]))
    ps.destroy_model_parallel()

    ensure_model_parallel(pp_size=2)
    group, pp_rank = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_rank()
    stages = [from_hf(hf, pp_rank=pp_rank, pp_size=2)]
    mbs = [(ids, mask)] * (2 if rank == 0 else 3)
    step = lambda stage, mb: forward(stage, *mb)  # noqa: E731
    seen["pipeline_microbatches"] = attempt(lambda: pipeline_forward_backward(stages, step, mbs, pp_group=group))
    bad_loss = "sum" if rank == 0 else None
    seen["pipeline_loss_fn"] = attempt(
        lambda: pipeline_forward_backward(stages, step, mbs[:2], pp_group=group, loss_fn=bad_loss))
    ps.destroy_model_parallel()

    ensure_model_parallel()  # no pipeline in Megatron's state: each rank builds the other rank's stage
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        swapped = [from_hf(hf, pp_rank=1 - rank, pp_size=2)]
    seen["pipeline_swapped_stages"] = attempt(
        lambda: pipeline_forward_backward(swapped, step, mbs[:2], pp_group=torch.distributed.group.WORLD))
    ps.destroy_model_parallel()
    return seen


def test_bad_input_on_one_rank_raises_the_same_error_on_every_rank():
    start = time.monotonic()
    with pytest.raises(RankError) as info:
        run_local(bad_mask_on_rank_one, 2, tiny_hf(), backend="gloo", timeout=120)
    message = str(info.value)
    assert message.startswith(
        "every rank (2 of 2) raised the same ValueError: rank 1 of 2 in the process group rejected its inputs: "
        "x has shape (4, 12) but attention_mask has shape (4, 11)"
    ), message
    assert time.monotonic() - start < 60  # no rank waited for the failing one in a collective


def test_each_kind_of_bad_input_fails_alike_everywhere():
    per_rank = run_local(caught_failures, 2, tiny_hf(), backend="gloo", timeout=120)
    assert per_rank[0] == per_rank[1], "every rank must raise the same error"
    seen = per_rank[0]
    kind, message = seen["different_batch"]
    assert kind == "ValueError" and message.startswith("the ranks of the process group got different batches")
    kind, message = seen["same_bad_labels"]
    assert kind == "ValueError" and "labels has shape (4, 11)" in message  # the argument named
    kind, message = seen["pipeline_microbatches"]
    assert kind == "ValueError" and "different numbers of stages and microbatches" in message
    assert "rank 0 has [1, 2], rank 1 has [1, 3]" in message
    kind, message = seen["pipeline_loss_fn"]
    assert kind == "TypeError" and message.startswith("rank 0 of 2 in the process group rejected its inputs")
    assert "loss_fn must be None" in message
    kind, message = seen["pipeline_swapped_stages"]  # the embedding and output layer where the chain has them
    assert kind == "ValueError" and "stage 0 of pipeline rank 0 is global stage 0 of 2" in message
    assert "lacks the embedding, holds the output layer" in message


def _stage_groups(rank, world_size, hf, init_first):
    import warnings

    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel

    if init_first:  # Megatron initialised without a pipeline, then a stage of a 2-stage one asked for
        ensure_model_parallel()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            from_hf(hf, pp_rank=rank, pp_size=2)
        ps.destroy_model_parallel()
        return [str(w.message) for w in seen if "packfwd: a stage of pp_size=2" in str(w.message)]
    from_hf(hf, pp_rank=rank, pp_size=2)
    sizes = (ps.get_pipeline_model_parallel_world_size(), ps.get_data_parallel_world_size(),
                     ps.get_pipeline_model_parallel_rank())
    ps.destroy_model_parallel()
    return sizes


def test_a_stage_built_under_a_launcher_has_its_pipeline_group():
    """Hazard: from_hf(pp_rank=r, pp_size=2) under a launcher left Megatron at PP=1, DP=2: its data-parallel group
    held both stages, and a gradient all-reduce over it added stage 0's layers to stage 1's, silently."""
    got = run_local(_stage_groups, 2, tiny_hf(), False, backend="gloo", timeout=120)
    assert got == [(2, 1, 0), (2, 1, 1)]  # pipeline of 2, data parallel of 1, each rank its own stage
    warned = run_local(_stage_groups, 2, tiny_hf(), True, backend="gloo", timeout=120)  # made earlier: said
    assert all(len(w) == 1 and "data parallelism of 2" in w[0] and "ensure_model_parallel(pp_size=2" in w[0]
               for w in warned)


def _virtual_stages_out_of_order(rank, world_size, hf):
    """PP=2 x VPP=3 (6 layers): rank 0 passes its virtual stages 1 and 2 swapped (neither holds the embedding
    or the output layer)."""
    from megatron.core import parallel_state as ps

    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.parallel import pipeline_forward_backward

    ensure_model_parallel(pp_size=2, vpp_size=3)
    pp_rank = ps.get_pipeline_model_parallel_rank()
    stages = [from_hf(hf, pp_rank=pp_rank, pp_size=2, vpp_rank=v, vpp_size=3) for v in range(3)]
    if rank == 0:
        stages = [stages[0], stages[2], stages[1]]
    ids, mask, _, _ = batch()
    forward = make_forward("thd")
    try:
        pipeline_forward_backward(stages, lambda stage, mb: forward(stage, *mb), [(ids, mask)],
                                  pp_group=ps.get_pipeline_model_parallel_group())
    except ValueError as exc:
        return str(exc)
    finally:
        ps.destroy_model_parallel()
    return "no error"


def test_virtual_stages_out_of_order_are_refused():
    """Hazard: the placement check read only the embedding and the output layer, so middle virtual stages in
    another order ran their layers at the wrong places in the chain: logits off by ~3.7, no error."""
    hf = randomise(Qwen2ForCausalLM(Qwen2Config(**{**TINY, "num_hidden_layers": 6}, num_key_value_heads=2)), 0)
    got = run_local(_virtual_stages_out_of_order, 2, hf, backend="gloo", timeout=120)
    assert got[0] == got[1], "every rank must raise the same error"
    assert "stages[1] of pipeline rank 0 was built for virtual stage 2" in got[0], got[0]
    assert "vpp_rank=v" in got[0]
