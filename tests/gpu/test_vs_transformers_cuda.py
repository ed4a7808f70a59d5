"""On the GPU, in bf16, packfwd's packed forward is as close to the float32 truth as transformers' padded forward.

The CPU tests check packfwd against transformers per sequence in float64.  On the GPU the bf16 paths differ from
each other by their roundings (varlen flash attention on packed tokens against sdpa on a padded batch, other GEMM
shapes), so two bf16 results cannot be compared bit for bit; what can be asserted is that packfwd's bf16 log-probs
are no further from the float32 model's than transformers' own bf16 log-probs are.  The float32 forwards (TF32 off)
are checked against each other too.  An RL batch: left-padded prompts, right-padded responses, 1B-Llama widths, 4
layers.  CUDA only (skipped elsewhere).
"""

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rl_batch(vocab: int, seed: int = 0, prompt_cols: int = 512, s: int = 2048, prompts=(300, 512, 17, 128),
             responses=(900, 1536, 1, 700)):
    """ids, mask [len(prompts), s] on the CPU: prompts left-padded in the first ``prompt_cols`` columns, responses
    right-padded after them."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, vocab, (len(prompts), s), generator=g)
    mask = torch.zeros(len(prompts), s, dtype=torch.bool)
    for r, (p, n) in enumerate(zip(prompts, responses)):
        mask[r, prompt_cols - p: prompt_cols + n] = True
    return ids, mask


def log_probs_of(model, ids, mask, packed: bool):
    import packfwd as pf
    from packfwd.logits import log_probs, vocab_parallel

    labels = pf.next_token_labels(ids, mask)
    with torch.no_grad():
        if packed:
            @vocab_parallel
            def processor(logits, labels, tp_group=None):
                return {"lp": log_probs(logits, labels, tp_group=tp_group)}

            lp = pf.make_forward("thd", logits_processor=processor)(model, ids, mask, labels=labels)["lp"]
        else:
            positions = (mask.long().cumsum(1) - 1).clamp_min(0)
            logits = model(input_ids=ids, attention_mask=mask.long(), position_ids=positions).logits
            lp = log_probs(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1).clamp_min(0)).view(ids.shape)
    return lp.float(), labels >= 0


def test_bf16_log_probs_as_close_to_fp32_as_transformers():
    from transformers import LlamaConfig, LlamaForCausalLM

    from packfwd.models import from_hf

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    cfg = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=7168, num_hidden_layers=4,
                      num_attention_heads=16, num_key_value_heads=8, max_position_embeddings=8192,
                      attn_implementation="sdpa")
    torch.manual_seed(0)
    hf32 = LlamaForCausalLM(cfg).cuda().eval()
    ids, mask = (t.cuda() for t in rl_batch(cfg.vocab_size))
    truth, scored = log_probs_of(hf32, ids, mask, packed=False)
    pf32 = from_hf(hf32, device="cuda", params_dtype=torch.float32)
    pf16 = from_hf(hf32, device="cuda", params_dtype=torch.bfloat16)
    hf16 = LlamaForCausalLM(cfg).cuda().eval()
    hf16.load_state_dict(hf32.state_dict())
    hf16 = hf16.to(torch.bfloat16)

    def err(lp):
        d = (lp - truth).abs()[scored]
        return float(d.mean()), float(d.max())

    e_pf32, e_pf16, e_hf16 = (err(log_probs_of(m, ids, mask, packed=p)[0])
                              for m, p in ((pf32, True), (pf16, True), (hf16, False)))
    print(f"|log p - fp32 transformers| mean, max: packfwd fp32 {e_pf32}, packfwd bf16 {e_pf16}, "
          f"transformers bf16 {e_hf16}")
    assert e_pf32[1] < 1e-3, e_pf32  # the same model in float32 (packfwd's reference attention on the CUDA side)
    assert e_pf16[0] <= 1.5 * e_hf16[0] + 2**-8, (e_pf16, e_hf16)
