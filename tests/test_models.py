"""packfwd.models: the CPU support shim, the builders, pipeline stages, and functional use.

Strategy: the model's rotary table is compared with Megatron-Core's own ``RotaryEmbedding.get_emb`` (run with
``torch.cuda.current_device`` pointed at the CPU for the comparison only); the built model is checked to be what
its constructor and spec describe (classes and shared RoPE, no instance patches); pipeline stages are composed one
after another in one process and compared with the unsplit model; ``torch.func.functional_call`` is compared
with loading the same weights into the module.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core import parallel_state
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

from packfwd import to_thd
from packfwd.forward import make_forward
from packfwd.layers import layer_partition
from packfwd.models import ModelArgs, build_model, is_value_model
from packfwd.models.mixers.attention import CoreAttention
from packfwd.models.runtime.cpu import config_overrides, is_host
from packfwd.models.runtime.gpt import ValueHead, model_args
from packfwd.models.convert.hf import load_weights
from packfwd.models.runtime.model import PackedGPTModel
from packfwd.models.mixers.rope import PackedRope, PackedRotaryEmbedding
from packfwd.models.runtime import StagePlacement, ensure_model_parallel, stage_process_groups

from .test_hf_interop import hf_model, ragged_batch

ARGS = ModelArgs(vocab_size=128, hidden_size=64, ffn_hidden_size=128, num_layers=4, num_attention_heads=4,
                 num_query_groups=2, head_dim=16, qkv_bias=True)


# ----------------------------------------------------------------------------------------------- CPU shim


@pytest.mark.parametrize("interleaved", [False, True])
def test_host_rotary_table_equals_megatrons(monkeypatch, interleaved):
    rope = PackedRotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved,
                                 rotary_base=500000, use_cpu_initialization=True)
    ours = rope.get_emb(11, offset=3)
    assert ours.device.type == "cpu" and rope.inv_freq.device.type == "cpu"

    original = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, rotary_interleaved=interleaved,
                               rotary_base=500000, use_cpu_initialization=True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: torch.device("cpu"))
    assert torch.equal(ours, original.get_emb(11, offset=3))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the unshimmed path works where CUDA exists")
def test_unshimmed_rotary_needs_cuda():
    """Why the shim exists: Megatron-Core's rotary table moves to CUDA on every call."""
    rope = RotaryEmbedding(kv_channels=16, rotary_percent=1.0, use_cpu_initialization=True)
    with pytest.raises((AssertionError, RuntimeError)):
        rope.get_emb(4)


def test_shim_applies_on_the_cpu_only():
    assert config_overrides("cpu") == {"use_cpu_initialization": True}
    assert config_overrides(torch.device("cuda", 1)) == {"use_cpu_initialization": False}
    assert is_host("cpu") and not is_host("cuda")
    model = build_model(ARGS)
    assert model.config.use_cpu_initialization and model.rotary_pos_emb.inv_freq.device.type == "cpu"
    assert all(p.device.type == "cpu" for p in model.parameters())
    assert not model.forward_on_host  # only sequence parallelism needs host collectives


def test_the_model_is_what_its_constructor_and_spec_build():
    args = ModelArgs(**{**ARGS.__dict__, "num_layers": 2, "value_head": True})
    model = build_model(args, attention_backend="reference", init=False)
    assert type(model) is PackedGPTModel and type(model.rotary_pos_emb) is PackedRotaryEmbedding
    assert type(model.output_layer) is ValueHead and is_value_model(model)
    cores = [m for m in model.modules() if isinstance(m, CoreAttention)]
    assert len(cores) == 2 and all(c.backend == "reference" for c in cores)
    rope = cores[0].rope
    assert isinstance(rope, PackedRope) and all(c.rope is rope for c in cores)  # one RoPE, from the spec params
    assert rope.rotary is model.rotary_pos_emb
    assert not model._forward_hooks and not model._forward_pre_hooks  # nothing hooked on afterwards
    plain = build_model(ARGS, init=False, packed_rope=False)  # Megatron-Core's THD RoPE: a constructor choice
    assert all(m.rope is None for m in plain.modules() if isinstance(m, CoreAttention))
    assert plain.rotary_pos_emb(16, packed_seq=True) is not None


def test_the_model_checks_positions_as_make_forward_does():
    """One positions check (``packfwd._validate.check_positions``) for ``make_forward`` and the model's own paths
    (BSHD, BSHD with a padding mask, THD): float positions raise the same TypeError everywhere (the model used to
    turn them into RoPE angles as given)."""
    model = build_model(ARGS, init=False)
    ids, mask = torch.randint(0, 128, (2, 5)), torch.ones(2, 5, dtype=torch.bool)
    positions = torch.arange(5).expand(2, 5).float()
    packed, info = to_thd(ids, mask)
    calls = {
        "make_forward": lambda p: make_forward("bshd")(model, ids, mask, position_ids=p),
        "bshd": lambda p: model(ids, p, None),
        "masked_rows": lambda p: model(ids, p, mask),
        "thd": lambda p: model(packed[None], p.reshape(1, -1), None, packed_seq_params=info.packed_seq_params()),
    }
    for name, call in calls.items():
        with pytest.raises(TypeError, match="position_ids has dtype torch.float32; pass integer positions"):
            call(positions)


def test_the_cp_place_rides_from_the_plan_to_the_attention():
    """The plan's CP place travels in its ``PackedSeqParams`` (``.cp``); the model checks it against the CP group
    its attention runs in (here one rank), where it used to run a rank's zigzag share as whole sequences."""
    from packfwd import plan_thd

    model = build_model(ARGS, init=False)
    ids, mask = torch.randint(0, 128, (2, 8)), torch.ones(2, 8, dtype=torch.bool)
    info = plan_thd(mask, cp_size=2, cp_rank=1)
    assert (info.packed_seq_params().cp.size, info.packed_seq_params().cp.rank) == (2, 1)
    packed = to_thd(ids, info)[0][None]
    with pytest.raises(ValueError, match="packed for context-parallel rank 1 of 2, but this model's attention runs "
                                         "as rank 0 of 1"):
        model(packed, None, None, packed_seq_params=info.packed_seq_params())
    model.config.context_parallel_size = 2  # a config that disagrees with the group the attention runs in
    try:
        with pytest.raises(ValueError, match="context_parallel_size=2 but its attention's CP group has 1 ranks"):
            make_forward("thd", cp_size=2, cp_rank=0, cp_group=object())(model, ids, mask)
    finally:
        model.config.context_parallel_size = 1


# ----------------------------------------------------------------------------------------------- runtime


def test_parallel_state_is_set_up_and_checked():
    ensure_model_parallel()
    assert torch.distributed.is_initialized() and parallel_state.model_parallel_is_initialized()
    assert parallel_state.get_tensor_model_parallel_world_size() == 1
    ensure_model_parallel(tp_size=1, cp_size=1)
    with pytest.raises(ValueError, match="tp_size=2"):
        ensure_model_parallel(tp_size=2)
    with pytest.raises(ValueError, match="cp_size=2"):
        build_model(ARGS, cp_size=2)
    groups = stage_process_groups(2, 4)
    assert groups.pp == StagePlacement(rank_=2, size_=4) and groups.embd is None
    assert stage_process_groups(0, 1).pp is parallel_state.get_pipeline_model_parallel_group()


# ----------------------------------------------------------------------------------------------- builders


def test_model_args_validation_and_read_back():
    with pytest.raises(ValueError, match="divide"):
        ModelArgs(vocab_size=8, hidden_size=64, ffn_hidden_size=8, num_layers=1, num_attention_heads=4,
                  num_query_groups=3)
    with pytest.raises(ValueError, match="positive int"):
        ModelArgs(vocab_size=0, hidden_size=64, ffn_hidden_size=8, num_layers=1, num_attention_heads=4)
    with pytest.raises(TypeError, match="ModelArgs"):
        build_model({"vocab_size": 128})
    assert model_args(build_model(ARGS, init=False)) == ARGS


def test_value_model_outputs_one_column():
    args = ModelArgs(**{**ARGS.__dict__, "value_head": True, "value_head_bias": True, "num_layers": 2})
    model = build_model(args)
    assert isinstance(model.output_layer, ValueHead) and model.output_layer.bias is not None
    assert not is_value_model(build_model(ARGS, init=False))
    ids, mask = ragged_batch("mixed")
    with torch.no_grad():
        raw = model(ids, None, None)
        values = make_forward("bshd")(model, ids, mask)
    assert raw.shape == (4, 12, 1) and values.shape == (4, 12)


def _composed(stages, ids, mask):
    """Run pipeline stages one after another (the THD packing as the forward does it)."""
    packed, info = to_thd(ids, mask)
    params, hidden = info.packed_seq_params(), None
    for stage in stages:
        if hidden is not None:
            stage.set_input_tensor(hidden)
        hidden = stage(packed[None], None, None, packed_seq_params=params)
    return hidden


@pytest.mark.parametrize(
    "num_layers, pp, vpp, first, last",
    [(4, 2, 1, None, None), (4, 2, 2, None, None), (5, 3, 1, 1, 2), (6, 3, 2, None, None)],
)
def test_stages_compose_to_the_whole_model(num_layers, pp, vpp, first, last):
    args = ModelArgs(**{**ARGS.__dict__, "num_layers": num_layers, "tie_embeddings": True})
    torch.manual_seed(0)
    whole = build_model(args)
    weights = {n: p.detach() for n, p in whole.named_parameters()}
    partition = layer_partition(num_layers, pp, vpp, first_stage_layers=first, last_stage_layers=last)
    stages = []
    for v in range(vpp):  # virtual stage 0 of every rank, then virtual stage 1, ...
        for r in range(pp):
            stage = build_model(args, pp_rank=r, pp_size=pp, vpp_rank=v, vpp_size=vpp, first_stage_layers=first,
                                last_stage_layers=last, init=False)
            layers = partition[r][v]
            assert [layer.layer_number for layer in stage.decoder.layers] == [i + 1 for i in layers]
            assert stage.pre_process == (r == 0 and v == 0) and stage.post_process == (r == pp - 1 and v == vpp - 1)
            own = {}
            for name, _ in stage.named_parameters():
                source = name
                if name.startswith("decoder.layers."):
                    local, rest = name[len("decoder.layers."):].split(".", 1)
                    source = f"decoder.layers.{layers[int(local)]}.{rest}"
                elif name == "output_layer.weight" and args.tie_embeddings:
                    source = "embedding.word_embeddings.weight"
                own[name] = weights[source]
            stages.append(load_weights(stage, own))
    ids, mask = ragged_batch("mixed")
    with torch.no_grad():
        want = make_forward("thd")(whole, ids, mask)
        packed_out = _composed(stages, ids, mask)
        middle = make_forward("thd")(stages[0], ids, mask)
    from packfwd import from_thd

    got = from_thd(packed_out[0], to_thd(ids, mask)[1])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert middle.shape == (int(mask.sum()), 1, 64)  # a first stage returns its hidden states [t, 1, h]


def test_functional_call_with_a_params_dict():
    hf = hf_model("llama-gqa")
    from packfwd.models import from_hf

    model = from_hf(hf)
    ids, mask = ragged_batch("left")
    forward = make_forward("thd")
    params = {n: p.detach() * 1.5 if n.endswith("layernorm.weight") else p.detach()
              for n, p in model.named_parameters()}
    with torch.no_grad():
        base = forward(model, ids, mask)
        functional = torch.func.functional_call(model, params, (), {"input_ids": ids, "position_ids": None,
                                                                    "attention_mask": None})
        through_forward = forward(_Functional(model, params), ids, mask)
        loaded = forward(load_weights(model, params), ids, mask)
    assert not torch.allclose(base, loaded)
    torch.testing.assert_close(through_forward, loaded, atol=1e-6, rtol=1e-6)
    assert functional.shape == (4, 12, 128)


class _Functional(torch.nn.Module):
    """``model`` called through ``torch.func.functional_call`` with ``params``."""

    def __init__(self, model, params):
        super().__init__()
        self.module, self.params = model, params

    def forward(self, **kwargs):
        return torch.func.functional_call(self.module, self.params, (), kwargs)


@pytest.mark.parametrize("family", ["llama", "qwen3", "qwen3_moe"])
def test_a_model_built_for_loading_carries_megatron_tensor_parallel_tags(family):
    """``init=False`` (what ``from_hf`` builds) tags every tensor-parallel weight as Megatron-Core's initialisation
    does: its grad-norm clipping counts an untagged shard once, on the first TP rank only (a silently wrong norm)."""
    from packfwd.models.mlp import Moe

    moe = Moe(num_experts=4, top_k=2, ffn_hidden_size=16, dense_layers=(0,)) if family == "qwen3_moe" else None
    args = ModelArgs(vocab_size=32, hidden_size=16, ffn_hidden_size=32, num_layers=2, num_attention_heads=2,
                     family=family, moe=moe)

    def tags(model):
        return {n: tuple(getattr(p, a, None) for a in ("tensor_model_parallel", "partition_dim", "partition_stride"))
                for n, p in model.named_parameters()}

    loaded, initialised = tags(build_model(args, init=False)), tags(build_model(args))
    assert loaded == initialised
    assert sum(t[0] is True for t in loaded.values()) >= 6
