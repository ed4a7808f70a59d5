"""``run_micro_batches(..., graphs=True)`` on CUDA: micro-batches padded to their buckets and replayed from CUDA graphs
(``packfwd.micro.graphs``).  Oracle: the same padded steps run eagerly (``StepGraphs(capture=False)``), which the
graphs must equal bit for bit (same kernels, torch's deterministic mode so the flash backward is too): the loss,
every output row and every parameter gradient, over two steps (the first warms up and captures each bucket, the
second only replays), forward + backward and forward-only.  Against the plain eager step (``graphs=False,
buckets=False``: other GEMM row counts, and the flash kernel where cuDNN takes the bucket plans) within bf16
rounding.  The default (``buckets=None``): padded where cuDNN's attention runs on bucket plans alone, the same bits as
``StepGraphs(capture=False)``; an MoE model's too, its experts given the real tokens only.  Graph oracles are
``StepGraphs(capture=False, head_quarters=True)``: the graphs' head size.  Also: it keeps its graphs on the forward
and reports their memory;
parameters updated in place (an optimizer) or replaced are seen by the replays; a processor that synchronises with
the host cannot be captured: one warning, and the bucket's eager step gives the same bits.

    PYTHONPATH=. python -m pytest -q tests/gpu/test_step_graphs_cuda.py
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

S = 384


@pytest.fixture
def deterministic():
    from packfwd.forward.deterministic import enabled

    with enabled(batch_invariant=False):
        yield


def llama():
    from transformers import LlamaConfig, LlamaForCausalLM

    from packfwd.models import from_hf

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512))
    return from_hf(hf, device="cuda", params_dtype=torch.bfloat16)


def batch(seed, n=24):
    """RL-like rows: left-padded prompts, right-padded responses; labels, a response mask, advantages."""
    import packfwd as pf

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(1, S // 4, (n,), generator=g)
    response = torch.randint(1, 3 * S // 4, (n,), generator=g)
    col = torch.arange(S)[None]
    mask = (col >= S // 4 - prompt[:, None]) & (col < S // 4 + response[:, None])
    ids = torch.randint(1, 512, (n, S), generator=g) * mask
    labels = pf.next_token_labels(ids, mask)
    loss_mask = (labels >= 0) & (col >= S // 4)
    seqlens = mask.sum(1).tolist()
    return ids.cuda(), mask.cuda(), labels.cuda(), loss_mask.cuda(), torch.randn(n, generator=g).cuda(), seqlens


def step(forward, model, plan, data, graphs, grad=True, **options):
    from packfwd.micro import run_micro_batches

    ids, mask, labels, loss_mask, adv, _ = data
    model.zero_grad(set_to_none=True)
    kw = dict(loss_fn=lambda o, adv: -o["log_probs"] * adv[:, None], loss_args={"adv": adv}, loss_mask=loss_mask) \
        if grad else {}
    with torch.set_grad_enabled(grad):
        out = run_micro_batches(forward, model, plan, ids, mask, dp_rank=0, graphs=graphs, labels=labels, **kw,
                                **options)
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return out, grads


def assert_same(a, b, what):
    (oa, ga), (ob, gb) = a, b
    assert torch.equal(oa.loss, ob.loss), f"{what}: loss {oa.loss} vs {ob.loss}"
    for k in oa.outputs:
        assert torch.equal(oa.outputs[k], ob.outputs[k]), f"{what}: output {k} differs"
    assert ga.keys() == gb.keys(), what
    for n in ga:
        assert torch.equal(ga[n], gb[n]), f"{what}: the gradient of {n} differs"


def setup():
    import packfwd as pf
    from packfwd.logits import log_probs_and_entropy
    from packfwd.micro import plan_micro_batches

    model = llama()
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    data = batch(1)
    plan = plan_micro_batches(data[-1], max_tokens=1024, **forward.layout.plan_args)  # 5 micro-batches, 2 buckets
    assert plan.num_micro_batches >= 3 and len(set(plan.buckets(0))) >= 2, (plan.tokens, plan.buckets(0))
    return model, forward, data, plan


@pytest.mark.parametrize("grad", [True, False], ids=["fwd+bwd", "forward-only"])
def test_graphs_equal_the_padded_eager_step_bit_for_bit(grad, deterministic):
    from packfwd.micro import StepGraphs

    model, forward, data, plan = setup()
    eager = step(forward, model, plan, data, StepGraphs(capture=False, head_quarters=True), grad)
    graphs = StepGraphs()
    first = step(forward, model, plan, data, graphs, grad)  # warm-up and capture of each bucket
    second = step(forward, model, plan, data, graphs, grad)  # replays only
    buckets = len(set(s for s in plan.buckets(0) if s[0]))  # a scoring forward's head rows split them up to 4x
    assert buckets <= graphs.captured <= 4 * buckets, graphs
    assert graphs.replayed >= plan.num_micro_batches, graphs
    assert graphs.memory_bytes > 0, graphs
    assert_same(first, eager, "first step")
    assert_same(second, eager, "replayed step")
    plain = step(forward, model, plan, data, False, grad, buckets=False)  # other GEMM row counts and attention kernel
    real = data[1]
    diff = (plain[0].outputs["log_probs"] - second[0].outputs["log_probs"])[real].abs()
    assert diff.max() < 5e-2, f"graphed vs plain log-probs: {diff.max()}"
    if grad:
        assert torch.isclose(plain[0].loss, second[0].loss, rtol=2e-2, atol=1e-3), (plain[0].loss, second[0].loss)


def test_graphs_are_kept_on_the_forward_and_see_parameter_updates(deterministic):
    from packfwd.micro import StepGraphs

    model, forward, data, plan = setup()
    step(forward, model, plan, data, True)
    step(forward, model, plan, data, True)
    graphs = forward.step_graphs
    assert isinstance(graphs, StepGraphs) and graphs.reason is None and graphs.replayed > 0, graphs
    print(f"graphs: {graphs}")
    with torch.no_grad():  # an optimizer's in-place update, then a parameter replaced outright
        for p in model.parameters():
            p.mul_(0.9)
        first = next(model.parameters())
        first.data = first.data.clone() * 1.1
    got = step(forward, model, plan, data, True)
    want = step(forward, model, plan, data, StepGraphs(capture=False, head_quarters=True))
    assert_same(got, want, "after the update")


def test_a_processor_that_syncs_falls_back_with_one_warning(deterministic):
    import packfwd as pf
    from packfwd.logits import log_probs_and_entropy
    from packfwd.micro import StepGraphs

    model, _, data, plan = setup()

    def syncing(logits, labels):
        out = log_probs_and_entropy(logits, labels)
        if float(labels.max()) < 0:  # a host read: not capturable
            raise AssertionError("no label")
        return out

    forward = pf.make_forward("thd", logits_processor=syncing)
    graphs = StepGraphs()
    with pytest.warns(UserWarning, match="could not capture"):
        got = [step(forward, model, plan, data, graphs) for _ in range(2)][-1]
    assert graphs.captured == 0 and graphs.reason.startswith("capture failed"), graphs
    # the abandoned capture leaves the device's random generator usable outside graphs (it used to stay in capture
    # mode: every later random op raised 'Offset increment outside graph capture')
    torch.randn(4, device="cuda")
    assert_same(got, step(forward, model, plan, data, StepGraphs(capture=False, head_quarters=True)), "fallback")


def test_the_default_pads_where_cudnn_takes_the_bucket_plans(deterministic):
    from packfwd.micro import StepGraphs
    from packfwd.models.mixers.attention import attention_backends

    model, forward, data, plan = setup()
    cudnn = "cudnn" in attention_backends(model, bucket_plans=True)
    default = step(forward, model, plan, data, False)
    held = forward.padded_steps
    if not cudnn:  # nvidia-cudnn-frontend missing: the plain step, and why
        assert held.eager == 0 and "not cuDNN" in held.reason, held
        assert_same(default, step(forward, model, plan, data, False, buckets=False), "default without cuDNN")
        return
    assert held.reason is None and held.eager == plan.num_micro_batches, held
    assert forward.attention_backend(model).endswith("; cudnn on bucket plans")
    assert_same(default, step(forward, model, plan, data, StepGraphs(capture=False)), "default vs padded")


def test_an_moe_models_default_pads_routes_no_pad_and_agrees_with_its_plain_step(deterministic, monkeypatch):
    """A bf16 Qwen3-MoE (2 MoE layers, 8 experts top-2) on CUDA: the default pads it where cuDNN takes the bucket
    plans, the same bits as ``StepGraphs(capture=False)``; its experts get the real tokens only (read in their
    forward, per micro-batch and layer); loss and log-probs within bf16 rounding of the plain step's."""
    import packfwd as pf
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    from megatron.core.transformer.moe.experts import SequentialMLP

    from packfwd.logits import log_probs_and_entropy
    from packfwd.micro import StepGraphs, plan_micro_batches
    from packfwd.models import from_hf
    from packfwd.models.mixers.attention import attention_backends

    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=64, vocab_size=512, num_experts=8, num_experts_per_tok=2,
                                            norm_topk_prob=True))
    model = from_hf(hf, device="cuda", params_dtype=torch.bfloat16)
    forward = pf.make_forward("thd", logits_processor=log_probs_and_entropy)
    data = batch(2)
    plan = plan_micro_batches(data[-1], max_tokens=1024, **forward.layout.plan_args)
    routed = []
    for cls in {type(m) for m in model.modules() if isinstance(m, SequentialMLP)}:
        monkeypatch.setattr(cls, "forward", lambda self, x, counts, probs, original=cls.forward: (
            routed.append(int(counts.sum())), original(self, x, counts, probs))[1])

    def run(graphs, **options):
        routed.clear()
        return step(forward, model, plan, data, graphs, **options), list(routed)

    (default, default_grads), default_routed = run(False)
    if "cudnn" not in attention_backends(model, bucket_plans=True):
        pytest.skip("nvidia-cudnn-frontend missing: the default runs the plain step")
    assert forward.padded_steps.reason is None and forward.padded_steps.eager == plan.num_micro_batches
    (padded, padded_grads), _ = run(StepGraphs(capture=False))
    assert_same((default, default_grads), (padded, padded_grads), "MoE default vs padded")
    (plain, _), plain_routed = run(False, buckets=False)
    per_layer = [2 * t for t in plan.tokens[0] for _ in range(2)]  # top-2, two MoE layers
    assert default_routed == plain_routed == per_layer, (default_routed, plain_routed, per_layer)
    assert any(t > used for (_, t), used in zip(plan.buckets(0), plan.tokens[0])), "no bucket adds padding"
    torch.testing.assert_close(default.loss, plain.loss, rtol=2e-2, atol=2e-2)
    scored = data[3].cpu()
    diff = (default.outputs["log_probs"].float() - plain.outputs["log_probs"].float()).cpu()[scored].abs()
    assert float(diff.mean()) < 2e-2, float(diff.mean())
