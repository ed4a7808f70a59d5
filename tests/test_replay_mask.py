"""Router replay with a per-token ``replay_mask``: replay where it is True, the current router's own top-k elsewhere.

Strategy.  The bounds are checked bit for bit against packfwd's own forwards: a mask of all True is the replay
without a mask, a mask of all False (with garbage in ``routed_experts``) is the free forward (logits, record, aux
loss, the router's gradient).  A mixed mask is checked against transformers run one sequence at a time with its
routers forced per token: at each MoE layer a replayed token takes the given experts, the others transformers'
own top-k of the logits *of that forced run* (so every earlier layer agrees), the weights as the family computes
them.  The record equals what that oracle used and the aux loss is its hand computation.  Garbage at the tokens
not replayed changes nothing (bitwise).  verl's R3 inputs: :func:`packfwd.verl.r3_replay_inputs` equals verl's
own ``align_r3_router_replay_data`` and ``build_r3_replay_mask``, and the drop-in fed them (zero placeholder
rows included) equals ``make_forward``'s replay with the same mask.  Bad masks are refused naming ``replay_mask``.
"""

from __future__ import annotations

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.models import from_hf

from .test_moe import hf_model, ragged_batch
from .test_replay import as_sets, forced_routers, updated

LAYOUTS = [("thd", {}), ("bshd", {})]


def routed_and_updated():
    """``(ids, mask, recorded, hf, model)``: Mixtral's record, then its routers updated (tokens moved)."""
    hf = hf_model("mixtral")
    ids, mask = ragged_batch()
    with torch.no_grad():
        recorded = make_forward("thd", record_routing=True)(from_hf(hf), ids, mask)["routed_experts"]
    hf = updated(hf)
    return ids, mask, recorded, hf, from_hf(hf)


def mixed_mask(mask):
    """Replay every other real token and never a sequence's last one (R3's pattern and more)."""
    replay = mask & (torch.arange(mask.shape[1]) % 2 == 0)
    last = mask & ~torch.cat([mask[:, 1:], torch.zeros_like(mask[:, :1])], 1)  # each row's last real token
    return replay & ~last


def with_garbage(recorded, mask, replay):
    """``recorded`` with a placeholder (expert 0 repeated) or out-of-range ids where it is not replayed."""
    garbage = recorded.masked_fill((mask & ~replay)[..., None, None], 0)
    garbage[..., 0, :] = garbage[..., 0, :].masked_fill((mask & ~replay)[..., None], 99)
    return garbage.masked_fill(~mask[..., None, None], -7)


def hf_mixed(hf, ids, mask, routed, replay):
    """transformers per sequence, routers forced per token: ``(logits [b, s, v], used [b, s, L, k] (-1 at
    padding), router logits [L, t, E] of the real tokens)``."""
    layers, k = routed.shape[-2:]
    logits = torch.zeros(*ids.shape, hf.config.vocab_size, dtype=torch.float64)
    used_all = torch.full((*ids.shape, layers, k), -1)
    router_logits = [[] for _ in range(layers)]
    for i in range(ids.shape[0]):
        if not mask[i].any():
            continue
        used = []
        with torch.no_grad(), forced_routers(hf, routed[i][mask[i]], replay[i][mask[i]], used):
            logits[i, mask[i]] = hf(ids[i][mask[i]][None]).logits[0].double()
        used_all[i, mask[i]] = torch.stack([c for _, c in used], 1)
        for layer, (x, _) in enumerate(used):
            router_logits[layer].append(x)
    return logits, used_all, [torch.cat(x) for x in router_logits]


@pytest.mark.parametrize("data_format, layout", LAYOUTS)
def test_all_true_is_the_replay_and_all_false_the_free_forward_bitwise(data_format, layout):
    ids, mask, recorded, hf, model = routed_and_updated()
    forward = make_forward(data_format, record_routing=True, moe_aux_loss=True, **layout)
    with torch.no_grad():
        replayed = forward(model, ids, mask, routed_experts=recorded)
        free = forward(model, ids, mask)
        every = forward(model, ids, mask, routed_experts=recorded, replay_mask=torch.ones_like(mask))
        garbage = with_garbage(recorded, mask, torch.zeros_like(mask))
        none = forward(model, ids, mask, routed_experts=garbage, replay_mask=torch.zeros_like(mask))
    assert not torch.equal(replayed["routed_experts"], free["routed_experts"])  # the update moved some tokens
    for got, want in ((every, replayed), (none, free)):
        for name in ("logits", "routed_experts", "moe_aux_loss"):
            assert torch.equal(got[name], want[name]), name


def test_all_false_gives_the_router_the_free_gradient_bitwise():
    ids, mask, recorded, hf, model = routed_and_updated()
    forward = make_forward("thd")
    weights = torch.randn(*ids.shape, hf.config.vocab_size, dtype=torch.float64,
                          generator=torch.Generator().manual_seed(3))
    routers = [m for m in model.modules() if type(m).__name__ == "PackedRouter"]
    grads = []
    for kwargs in ({}, dict(routed_experts=with_garbage(recorded, mask, torch.zeros_like(mask)),
                            replay_mask=torch.zeros_like(mask))):
        model.zero_grad(set_to_none=True)
        (forward(model, ids, mask, **kwargs) * weights)[mask].sum().backward()
        grads.append([r.weight.grad.clone() for r in routers])
    assert all(g.abs().sum() > 0 for g in grads[0])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("data_format, layout", LAYOUTS)
def test_mixed_mask_equals_transformers_forced_per_token(data_format, layout):
    ids, mask, recorded, hf, model = routed_and_updated()
    replay = mixed_mask(mask)
    forward = make_forward(data_format, record_routing=True, moe_aux_loss=True, **layout)
    with torch.no_grad():
        got = forward(model, ids, mask, routed_experts=with_garbage(recorded, mask, replay), replay_mask=replay)
        clean = forward(model, ids, mask, routed_experts=recorded, replay_mask=replay)
        replayed = forward(model, ids, mask, routed_experts=recorded)["logits"]
        free = forward(model, ids, mask)["logits"]
    want, used, router_logits = hf_mixed(hf, ids, mask, recorded, replay)
    torch.testing.assert_close(got["logits"][mask].double(), want[mask], atol=1e-5, rtol=1e-5)
    assert not got["logits"][~mask].any()
    assert (got["logits"] - replayed).abs().max() > 1e-3 and (got["logits"] - free).abs().max() > 1e-3  # controls
    # the record holds the experts used: the given ones where replayed, the router's own elsewhere
    assert torch.equal(as_sets(got["routed_experts"][mask]), as_sets(used[mask]))
    assert torch.equal(got["routed_experts"][replay], recorded[replay])
    assert (got["routed_experts"][~mask] == -1).all()
    # garbage where not replayed changes nothing, bit for bit
    for name in ("logits", "routed_experts", "moe_aux_loss"):
        assert torch.equal(got[name], clean[name]), name
    # the aux loss counts the assignments used, against the current probabilities (transformers' formula)
    layers, experts = len(router_logits), hf.config.num_local_experts
    probs = torch.cat([torch.softmax(x.double(), -1) for x in router_logits])  # [layers * t, E]
    chosen = torch.cat([used[mask][:, l] for l in range(layers)])  # [layers * t, k]
    one_hot = torch.nn.functional.one_hot(chosen, experts).double()
    aux = (one_hot.mean(0) * probs.mean(0)[None]).sum() * experts
    torch.testing.assert_close(got["moe_aux_loss"].double(), aux, atol=1e-6, rtol=1e-6)  # as test_replay


def test_ids_are_checked_only_where_replayed():
    ids, mask, recorded, hf, model = routed_and_updated()
    replay = mixed_mask(mask)
    forward = make_forward("thd")
    with torch.no_grad():
        forward(model, ids, mask, routed_experts=with_garbage(recorded, mask, replay), replay_mask=replay)  # accepted
        at = replay.nonzero()[0].tolist()
        bad = recorded.clone()
        bad[at[0], at[1], 0, 0] = 4  # a replayed real token: 4 experts, ids in [0, 4)
        with pytest.raises(ValueError, match=r"routed_experts holds expert ids .* outside \[0, 4\)"):
            forward(model, ids, mask, routed_experts=bad, replay_mask=replay)
        bad = recorded.clone()
        bad[at[0], at[1], 0, 1] = bad[at[0], at[1], 0, 0]
        with pytest.raises(ValueError, match="routed_experts repeats an expert"):
            forward(model, ids, mask, routed_experts=bad, replay_mask=replay)


def test_bad_replay_mask_names_it():
    ids, mask, recorded, hf, model = routed_and_updated()
    forward = make_forward("thd")
    with pytest.raises(TypeError, match="replay_mask must be a bool tensor, got torch.int64"):
        forward(model, ids, mask, routed_experts=recorded, replay_mask=mask.long())
    with pytest.raises(ValueError, match=r"replay_mask has shape \(4, 8\); .*\[4, 9\]"):
        forward(model, ids, mask, routed_experts=recorded, replay_mask=mask[:, :8])
    with pytest.raises(TypeError, match="replay_mask= .* needs routed_experts="):
        forward(model, ids, mask, replay_mask=mask)
    jagged = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)], layout=torch.jagged)
    routes = torch.nested.nested_tensor([recorded[i][mask[i]] for i in range(4)], layout=torch.jagged)
    short = torch.nested.nested_tensor([mask[i][mask[i]][:-1] for i in range(4)], layout=torch.jagged)
    with pytest.raises(ValueError, match="replay_mask has shape jagged with 17 tokens"):
        forward(model, jagged, routed_experts=routes, replay_mask=short)
    with pytest.raises(ValueError, match="replay_mask has shape \\(4, 9\\)"):  # padded where the ids are jagged
        forward(model, jagged, routed_experts=routes, replay_mask=mask)


def verl_r3_batch(ids, mask, recorded):
    """A verl-shaped R3 batch: jagged ids, the rollout's routes (one row short for sequences 0 and 3, whose last
    token the rollout never routed), verl's response mask ``[b, r]`` (sequence 2 has no response token)."""
    lengths = mask.sum(1).tolist()
    jagged = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)], layout=torch.jagged)
    keep = [n - 1 if i in (0, 3) else n for i, n in enumerate(lengths)]
    routes = torch.nested.nested_tensor([recorded[i][mask[i]][:keep[i]].to(torch.int16) for i in range(4)],
                                        layout=torch.jagged)
    response = torch.zeros(4, 5, dtype=torch.long)
    response[0, :4], response[1, :2], response[3, :3] = 1, 1, 1
    return jagged, routes, response


def load_verl_router_replay_utils():
    """verl's ``verl/utils/megatron/router_replay_utils.py`` on its own (verl's package imports ray), its verl
    imports stood in for (the two R3 functions use torch alone); None without verl."""
    import importlib.util
    import types

    from .verl_ref import load_with_stubs

    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    util = types.SimpleNamespace(postprocess_packed_seqs=None, postprocess_thd_engine=None,
                                 preprocess_packed_seqs=None, preprocess_thd_engine=None)
    stubs = {"verl.models.mcore.util": util, "verl.utils.device": types.SimpleNamespace(get_device_name=lambda: "cpu"),
             "verl.utils.megatron.router_replay_patch": types.SimpleNamespace(RouterReplay=object,
                                                                              RouterReplayAction=object)}
    path = f"{spec.submodule_search_locations[0]}/utils/megatron/router_replay_utils.py"
    return load_with_stubs(path, "packfwd_ref_verl_router_replay_utils", stubs)


def test_r3_inputs_are_verls():
    """:func:`packfwd.verl.r3_replay_inputs` equals verl 0.9.1's ``align_r3_router_replay_data`` and
    ``build_r3_replay_mask`` on the same batch."""
    from packfwd.verl import r3_replay_inputs

    router_replay_utils = load_verl_router_replay_utils()
    if router_replay_utils is None:
        pytest.skip("verl is not installed")

    ids, mask, recorded, _, _ = routed_and_updated()
    jagged, routes, response = verl_r3_batch(ids, mask, recorded)
    aligned, replay = r3_replay_inputs(routes, jagged, response)
    want_routes = router_replay_utils.align_r3_router_replay_data(routes, jagged)
    want_mask = router_replay_utils.build_r3_replay_mask(jagged, response)
    assert aligned.dtype == routes.dtype and torch.equal(aligned.offsets(), jagged.offsets())
    assert torch.equal(aligned.values(), want_routes.values())
    assert replay.dtype == torch.bool and torch.equal(replay.values(), want_mask.values())
    last = jagged.offsets()[1:] - 1  # each sequence's last token: a placeholder row where the rollout is short
    assert (aligned.values()[last[[0, 3]]] == 0).all() and not replay.values()[last].any()
    assert not replay.values()[jagged.offsets()[2]:jagged.offsets()[3]].any()  # no response: routed natively
    with pytest.raises(ValueError, match="routed_experts has sequences of lengths"):
        r3_replay_inputs(routes, torch.nested.nested_tensor([x[:-2] for x in jagged.unbind()], layout=torch.jagged),
                         response)


@pytest.mark.parametrize("data_format", ["thd", "bshd"])
def test_the_verl_drop_in_replays_an_r3_batch_as_packfwd(data_format):
    """verl's R3 batch (placeholder rows of zeros at the rollout's missing last routes) through the drop-in with
    its ``replay_mask`` equals ``make_forward``'s replay with the same mask; without the mask the placeholder is
    refused (expert 0 repeated)."""
    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.verl import gptmodel_forward_model_engine, r3_replay_inputs

    ensure_model_parallel()
    ids, mask, recorded, hf, model = routed_and_updated()
    jagged, routes, response = verl_r3_batch(ids, mask, recorded)
    aligned, replay = r3_replay_inputs(routes, jagged, response)
    padded_routes = torch.zeros_like(recorded)
    padded_routes[mask] = aligned.values().long()
    padded_replay = torch.zeros_like(mask)
    padded_replay[mask] = replay.values()
    with torch.no_grad():
        want = make_forward("thd")(model, ids, mask, routed_experts=padded_routes, replay_mask=padded_replay)
        got = gptmodel_forward_model_engine(model, jagged, {}, data_format=data_format, routed_experts=aligned,
                                            replay_mask=replay).values()
        every = make_forward("thd")(model, ids, mask, routed_experts=recorded)
    torch.testing.assert_close(got, want[mask], atol=1e-10, rtol=1e-10)
    assert (got - every[mask]).abs().max() > 1e-3  # the native tokens are not the record's
    with pytest.raises(ValueError, match="routed_experts repeats an expert"):
        gptmodel_forward_model_engine(model, jagged, {}, data_format=data_format, routed_experts=aligned)
    with pytest.raises(TypeError, match="replay_mask= .* needs routed_experts="):
        gptmodel_forward_model_engine(model, jagged, {}, data_format=data_format, replay_mask=replay)


def test_micro_batches_cut_the_mask_with_the_routes():
    """``run_micro_batches(..., routed_experts=R, replay_mask=M)``: each micro-batch replays its rows of both (cut
    like every per-token argument); outputs and record equal the whole batch's forward."""
    from packfwd.micro import plan_micro_batches, run_micro_batches

    ids, mask, recorded, hf, model = routed_and_updated()
    replay = mixed_mask(mask)
    forward = make_forward("thd", record_routing=True)
    garbage = with_garbage(recorded, mask, replay)
    with torch.no_grad():
        want = forward(model, ids, mask, routed_experts=garbage, replay_mask=replay)
        plan = plan_micro_batches(mask.sum(1).tolist(), max_tokens=12, **forward.layout.plan_args)
        assert sum(len(mb) > 0 for mb in plan.micro_batches[0]) > 1  # several micro-batches
        got = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, routed_experts=garbage, replay_mask=replay)
    assert got.rows == list(range(ids.shape[0]))
    assert torch.equal(got.outputs["routed_experts"], want["routed_experts"])
    torch.testing.assert_close(got.outputs["logits"], want["logits"], atol=1e-10, rtol=1e-10)


def test_routes_of_every_decoder_layer_replay_the_moe_layers_rows():
    """``routed_experts`` covering every decoder layer (``[b, s, num_layers, k]``, as a rollout engine may give them,
    verl indexing them by layer number): each MoE layer takes its own layer's row, the dense layer's row (here a
    placeholder of zeros) is ignored; equal bit for bit to the MoE layers' routes, on the whole model, on a
    pipeline stage and through the verl drop-in with verl's R3 mask."""
    from packfwd.models.runtime import ensure_model_parallel
    from packfwd.verl import gptmodel_forward_model_engine

    from .test_parallel_families import moe_model

    ensure_model_parallel()
    hf = moe_model(layers=4)  # Qwen3-MoE, layer 1 dense: MoE layers 0, 2, 3
    ids, mask = ragged_batch()
    replay = mixed_mask(mask)
    forward = make_forward("thd", record_routing=True)
    with torch.no_grad():
        recorded = forward(from_hf(hf), ids, mask)["routed_experts"]  # [b, s, 3, k]
    every = torch.zeros(*recorded.shape[:2], 4, recorded.shape[3], dtype=torch.int32)
    every[:, :, [0, 2, 3]] = recorded.to(torch.int32)
    hf = updated(hf)
    model = from_hf(hf)
    stage = from_hf(hf, pp_rank=1, pp_size=2)  # decoder layers 2 and 3
    with torch.no_grad():
        for kwargs in ({}, {"replay_mask": replay}):
            want = forward(model, ids, mask, routed_experts=recorded, **kwargs)
            got = forward(model, ids, mask, routed_experts=every, **kwargs)
            assert torch.equal(got["logits"], want["logits"]) and torch.equal(got["routed_experts"],
                                                                              want["routed_experts"])
        plain = make_forward("thd")
        hidden = plain(from_hf(hf, pp_rank=0, pp_size=2), ids, mask, routed_experts=recorded[:, :, :1])
        stage.set_input_tensor(hidden)
        want = plain(stage, ids, mask, routed_experts=recorded[:, :, 1:])
        stage.set_input_tensor(hidden)
        assert torch.equal(plain(stage, ids, mask, routed_experts=every), want)
        jagged = torch.nested.nested_tensor([ids[i][mask[i]] for i in range(4)], layout=torch.jagged)
        nested = [torch.nested.nested_tensor([x[i][mask[i]] for i in range(4)], layout=torch.jagged)
                  for x in (recorded, every, replay)]
        want = gptmodel_forward_model_engine(model, jagged, {}, routed_experts=nested[0], replay_mask=nested[2])
        got = gptmodel_forward_model_engine(model, jagged, {}, routed_experts=nested[1], replay_mask=nested[2])
        assert torch.equal(got.values(), want.values())
        with pytest.raises(ValueError, match=r"routed_experts has shape .*\(or every one of its 4 decoder layers"):
            forward(model, ids, mask, routed_experts=every[:, :, :2])
