"""A whole training step of a packfwd model (forward + backward of a log-prob loss) captured once as a CUDA graph
with a bucket plan (``forward.plan(..., bucket=)``, ``plan=`` in the captured forward), then replayed for new
batches of other lengths: the loss, the log-probs and every parameter gradient are the bits of the same step run
eagerly with each batch's bucket plan, and within bf16 rounding of the step planned without a bucket.  A Llama,
and a Qwen3-MoE: its grouped experts take ``t * top_k`` rows whatever the routing (the sink rows unwritten by
the grouped GEMMs, never read), so the MoE layers capture too.  For each
CUDA attention backend present (torch's flash kernel; cuDNN's when nvidia-cudnn-frontend is installed), under
torch's deterministic mode (captured in it too): without it the flash backward's atomic ``dq`` sums differ from run to
run, replayed or not.

    PYTHONPATH=. python -m pytest -q tests/gpu/test_cuda_graph_step.py
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

B, S = 4, 512


def batch(seed, vocab):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, S // 2, (B,), generator=g)
    response = torch.randint(1, S // 2, (B,), generator=g)
    response[seed % B] = S // 2  # one full response
    ids = torch.randint(1, vocab, (B, S), generator=g)
    col = torch.arange(S)[None]
    mask = (col >= S // 2 - prompt[:, None]) & (col < S // 2 + response[:, None])
    return ids.cuda(), mask.cuda()


@pytest.fixture
def deterministic():  # warn_only=True would leave the flash backward atomic (it only warns)
    from packfwd.forward.deterministic import enabled

    with enabled(batch_invariant=False):
        yield


def hf_model(kind):
    """A tiny Llama, or a Qwen3-MoE (8 experts top-2: the grouped experts, whose dispatcher makes no host sync)."""
    if kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        return LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                              head_dim=64, vocab_size=512, decoder_sparse_step=1,
                                              mlp_only_layers=[]))


@pytest.mark.parametrize("kind", ["llama", "qwen3_moe"])
@pytest.mark.parametrize("backend", ["torch_varlen", "cudnn"])
def test_a_replayed_step_equals_the_eager_step_for_new_batches(backend, kind, deterministic):
    import packfwd as pf
    from packfwd.layout.bucket import Bucket, copy_plan_
    from packfwd.logits import log_probs
    from packfwd.models import from_hf
    from packfwd.models.mixers.varlen import available_backends

    if backend not in available_backends("cuda"):
        pytest.skip(f"{backend} is not installed here")
    torch.manual_seed(0)
    model = from_hf(hf_model(kind), device="cuda", params_dtype=torch.bfloat16, attention_backend=backend)
    forward = pf.make_forward("thd", logits_processor=lambda logits, labels: {"lp": log_probs(logits, labels)})
    bucket = Bucket(tokens=B * S, max_seqlen=S)

    def step(ids, labels, plan):
        lp = forward(model, ids, plan=plan, labels=labels)["lp"]
        loss = -lp.sum() / (labels >= 0).sum()
        loss.backward()
        return loss.detach(), lp.detach()

    def grads():
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ids0, mask0 = batch(0, 512)
    static_ids, static_labels = ids0.clone(), pf.next_token_labels(ids0, mask0)
    captured = forward.plan(ids0, mask0, bucket=bucket)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step(static_ids, static_labels, captured)
            model.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step(static_ids, static_labels, captured)
    graph_grads = {n: p.grad for n, p in model.named_parameters()}  # what every replay writes

    for seed in (1, 2, 3):
        ids, mask = batch(seed, 512)
        labels = pf.next_token_labels(ids, mask)
        plan = forward.plan(ids, mask, seqlens=mask.sum(1).tolist(), bucket=bucket)
        static_ids.copy_(ids)
        static_labels.copy_(labels)
        copy_plan_(captured, plan)
        graph.replay()
        replayed = (out[0].clone(), out[1].clone(), {n: g.clone() for n, g in graph_grads.items()})
        model.zero_grad(set_to_none=True)
        loss, lp = step(ids, labels, plan)  # eager, the same bucket plan
        assert torch.equal(replayed[0], loss) and torch.equal(replayed[1], lp), f"batch {seed}: outputs differ"
        for name, g in grads().items():
            assert torch.equal(replayed[2][name], g), f"batch {seed}: the gradient of {name} differs"
        model.zero_grad(set_to_none=True)
        loss_plain, lp_plain = step(ids, labels, forward.plan(ids, mask))  # no bucket: bf16 rounding apart
        model.zero_grad(set_to_none=True)
        real = labels >= 0
        diff = (lp[real] - lp_plain[real]).abs()
        if kind == "llama":
            assert diff.max() < 5e-2, f"batch {seed}: bucket vs plain log-probs"
        else:  # bf16 rounding of another attention shape may tip a near-tie to another expert
            assert diff.mean() < 1e-2, f"batch {seed}: bucket vs plain log-probs {diff.mean()}"
        assert torch.isclose(loss, loss_plain, rtol=1e-2), f"batch {seed}: bucket vs plain loss"
