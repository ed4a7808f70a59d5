"""packfwd's MoE router beyond softmax top-k: what it leaves to Megatron-Core and what it does itself."""

from __future__ import annotations

import torch

from packfwd.models.router import PackedRouter


def tiny_router(**config) -> PackedRouter:
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.core.transformer.transformer_config import TransformerConfig

    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel()
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, num_moe_experts=4,
                               moe_router_topk=2, moe_ffn_hidden_size=8, moe_router_load_balancing_type="none",
                               use_cpu_initialization=True, **config)
    return PackedRouter(config, ProcessGroupCollection.use_mpu_process_groups())


def test_the_router_compiles_nothing():
    """Megatron-Core compiles ``TopKRouter._apply_expert_bias``; megatron-core 0.19.2's compiled one fails under
    torch 2.11 (``list indices must be integers or slices, not torch.device``), so packfwd's router never calls
    it: routing runs no frame through Dynamo."""
    from torch._dynamo.utils import counters

    router = tiny_router()
    torch._dynamo.reset()
    counters.clear()
    probs, routing_map = router(torch.randn(3, 1, 8), torch.tensor([[False], [True], [False]]))
    assert routing_map.sum(-1).tolist() == [2, 0, 2]
    assert not counters["frames"], dict(counters["frames"])
