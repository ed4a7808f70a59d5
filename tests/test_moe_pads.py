"""Layout pads never reach an MoE model's routers, whichever path packs the batch (issue 19, part 3).

Strategy: a tiny float64 Mixtral (3 MoE layers, 4 experts, top-2: tests/test_moe.py's) on a ragged batch of 21
real tokens; the expert load (tokens handed to each expert, read where Megatron-Core's experts run, as
tests/test_moe.py measures it) must be ``3 * 2 * 21 = 126`` however many layout pads the packing adds: verl's
engine forward with a length bucket, verl's padded forward's THD call under verl's TP alignment and a length
bucket (the call ``model_forward_gen`` builds, run on the tp=1 model), and the model called directly with
packfwd's own ``PackedSeqParams`` (the low-level path).  GLM-4.5's expert-bias token counts
(``local_tokens_per_expert``) likewise.  The mask the model derives from packfwd's params equals the plan's, per
CP rank.  Before the fix the engine with the bucket routed 384 slots, the direct call 240, and the padded
forward's THD call carried no mask.
"""

from __future__ import annotations

import functools

import pytest
import torch

from packfwd.forward import make_forward
from packfwd.layout import to_thd
from packfwd.models import from_hf
from packfwd.models.runtime import ensure_model_parallel
from packfwd.verl import gptmodel_forward_model_engine as engine
from packfwd.verl.layouts import VerlThd
from packfwd.engine import Batch, Engine
from packfwd.verl.padded import _verl_call

from .test_moe import expert_load, hf_model, ragged_batch

ROUTED = 3 * 2  # three MoE layers, top-2


@pytest.fixture(scope="module")
def mixtral():
    ensure_model_parallel()
    return from_hf(hf_model("mixtral"))


def nested(ids, mask):
    return torch.nested.nested_tensor([ids[i][mask[i]] for i in range(ids.shape[0])], layout=torch.jagged)


@pytest.mark.parametrize("bucket", [None, 64])
def test_verl_engine_routes_no_length_bucket_pad(mixtral, bucket):
    """``pad_to_length_bucket=64`` packs 64 slots for 21 tokens: 126 routed, not 384; logits unchanged."""
    ids, mask = ragged_batch()
    batch = nested(ids, mask)
    load = expert_load(mixtral, lambda m, *_: engine(m, batch, {}, pad_to_length_bucket=bucket), None, None)
    assert int(load.sum()) == ROUTED * int(mask.sum())
    with torch.no_grad():
        plain, bucketed = engine(mixtral, batch, {}), engine(mixtral, batch, {}, pad_to_length_bucket=bucket)
    torch.testing.assert_close(bucketed.values(), plain.values(), atol=1e-12, rtol=0)


def test_verl_engine_ors_router_padding_mask_with_the_plan(mixtral):
    """verl's ``router_padding_mask`` [1, t] (the second sequence's 5 tokens) and the bucket's pads both kept out."""
    ids, mask = ragged_batch()
    batch = nested(ids, mask)
    pads = torch.zeros(1, 64, dtype=torch.bool)
    pads[0, 9:14] = True
    load = expert_load(mixtral, lambda m, *_: engine(m, batch, {}, pad_to_length_bucket=64, router_padding_mask=pads),
                       None, None)
    assert int(load.sum()) == ROUTED * (int(mask.sum()) - 5)
    with pytest.raises(ValueError, match="router mask .*router_padding_mask.* has shape"):
        engine(mixtral, batch, {}, pad_to_length_bucket=64, router_padding_mask=pads[:, :21])


@pytest.mark.parametrize("tp, kw", [(2, {}), (1, dict(length_bucket=16))])
def test_verl_padded_thd_call_keeps_pads_from_routers(mixtral, tp, kw):
    """``model_forward_gen``'s THD call (verl's TP alignment, a length bucket) carries the plan's pads."""
    ids, mask = ragged_batch()
    layout = VerlThd(tp, 1, 0, None, **kw)
    call = Engine(layout, call=functools.partial(_verl_call, thd=True, vision=False, packed_ids=True),
                  tp_size=tp, check_cp=False).prepare(mixtral, Batch(ids, mask)).call
    info = layout.plan(ids, mask)
    assert torch.equal(call["padding_mask"], info.padding_mask())
    assert int(info.padding_mask().sum()) > 0
    load = expert_load(mixtral, lambda m, *_: m(**call), None, None)
    assert int(load.sum()) == ROUTED * int(mask.sum())


def test_direct_call_with_packfwds_params_routes_no_pad(mixtral):
    """``model(ids, None, None, packed_seq_params=info.packed_seq_params())`` at seq_align=8 (40 slots): 126
    routed, not 240, and the logits equal ``make_forward``'s; a ``padding_mask`` given is used as given."""
    ids, mask = ragged_batch()
    packed, info = to_thd(ids, mask, seq_align=8)
    params = info.packed_seq_params()

    def direct(m, *_, **kw):
        return m(packed.reshape(1, -1), None, None, packed_seq_params=params, **kw)

    assert int(expert_load(mixtral, direct, None, None).sum()) == ROUTED * int(mask.sum())
    none = torch.zeros(1, packed.shape[0], dtype=torch.bool)  # the caller's mask wins: every slot routed
    assert int(expert_load(mixtral, lambda m, *_: direct(m, padding_mask=none), None, None).sum()) == ROUTED * 40
    with torch.no_grad():
        got = direct(mixtral)[0][~info.padding_mask()[0]]
        want = make_forward("thd", seq_align=8)(mixtral, ids, mask)[mask]
    torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_glm_expert_bias_counts_skip_verl_bucket_pads():
    """GLM-4.5's router counts tokens per expert for its expert-bias update (with grad): real tokens only."""
    import transformers

    from packfwd.models.mlp.router import PackedRouter

    torch.manual_seed(0)
    cfg = transformers.Glm4MoeConfig(
        vocab_size=64, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
        n_group=1, topk_group=1, first_k_dense_replace=1, n_shared_experts=1)
    model = from_hf(transformers.Glm4MoeForCausalLM(cfg).double())
    router = next(m for m in model.modules() if isinstance(m, PackedRouter))
    seqs = [torch.randint(1, 64, (n,)) for n in (9, 5, 1, 6)]
    router.local_tokens_per_expert.zero_()
    engine(model, torch.nested.nested_tensor(seqs, layout=torch.jagged), {}, pad_to_length_bucket=64)
    assert int(router.local_tokens_per_expert.sum()) == 2 * 21
