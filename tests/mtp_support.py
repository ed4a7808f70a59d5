"""Helpers of test_mtp.py: the model, the ragged batch, the plain per-sequence MTP reference, and the work of each
rank of the CP=2 world.

The reference runs one sequence at a time, unpacked and unpadded, through the model's own submodules, with no
roll of a packed buffer: the decoder (embedding, layers, final norm), then for each depth ``k`` the MTP layer's
parts in DeepSeek-V3's order (``enorm`` of the embedding of the token ``k`` places later, 0 past the end;
``hnorm`` of the previous depth's hidden state; ``eh_proj`` of both; the inner transformer layer; the final
norm) and the shared output layer; depth ``k``'s log-prob at token ``i`` is that of token ``i + k + 1``.
"""

from __future__ import annotations

import torch

from packfwd.models import ModelArgs

ARGS = ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=2, num_attention_heads=4,
                 num_query_groups=2, mtp_num_layers=2)
TIED = ModelArgs(**{**ARGS.__dict__, "tie_embeddings": True})
LENGTHS = [1, 2, 3, 5, 10, 7]  # shorter than the depths, exactly depth + 1, longer
TOL = dict(atol=2e-5, rtol=2e-5)


def batch(seed: int = 0):
    """``ids [6, 12]``, ``mask`` (right, left and holey padding), ``loss_mask`` (the main head's: a random
    subset of each sequence's tokens), the weights of the test loss ``[6, 12, 2]``."""
    g = torch.Generator().manual_seed(seed)
    b, s = len(LENGTHS), 12
    mask = torch.zeros(b, s, dtype=torch.bool)
    for i, n in enumerate(LENGTHS):
        side = ("right", "left", "holes")[i % 3]
        if side == "right":
            mask[i, :n] = True
        elif side == "left":
            mask[i, s - n:] = True
        else:
            cols = torch.randperm(s, generator=g)[:n]
            mask[i, cols] = True
    ids = torch.randint(1, ARGS.vocab_size, (b, s), generator=g).masked_fill(~mask, 0)
    loss_mask = (torch.rand(b, s, generator=g) < 0.7) & mask
    weights = torch.randn(b, s, ARGS.mtp_num_layers, generator=g)
    return ids, mask, loss_mask, weights


def build(args=ARGS, **kw):
    from packfwd.models import build_model

    torch.manual_seed(0)
    return build_model(args, attention_backend="reference", **kw)


def _inner(layer):
    return getattr(layer, "mtp_model_layer", None) or layer.transformer_layer


def reference_sequence(model, seq: torch.Tensor):
    """One sequence ``[n]`` alone: main logits ``[n, v]`` and every depth's log-prob of its label ``[n, D]``
    (0 where the sequence ends first)."""
    n, depths = seq.shape[0], len(model.mtp.layers)
    rope = model.rotary_pos_emb(n)  # positions 0..n-1, [n, 1, 1, d]
    hidden = model.decoder(hidden_states=model.embedding(input_ids=seq[None], position_ids=None),
                           attention_mask=None, rotary_pos_emb=rope)  # [n, 1, h], final norm applied
    weight = model.shared_embedding_or_output_weight() if model.share_embeddings_and_output_weights else None
    main = model.output_layer(hidden, weight=weight)[0][:, 0]
    out = []
    for k, layer in enumerate(model.mtp.layers, start=1):
        later = torch.cat([seq[k:], seq.new_zeros(min(k, n))])  # token i + k, 0 past the end
        emb = model.embedding(input_ids=later[None], position_ids=None)
        mixed = layer.eh_proj(torch.cat([layer.enorm(emb), layer.hnorm(hidden)], dim=-1))[0]
        hidden = layer.final_layernorm(_inner(layer)(hidden_states=mixed, attention_mask=None,
                                                     rotary_pos_emb=rope)[0])
        log_p = torch.log_softmax(model.output_layer(hidden, weight=weight)[0][:, 0].float(), dim=-1)
        depth_lp = log_p.new_zeros(n)
        if n > k + 1:
            depth_lp = torch.cat([log_p[torch.arange(n - k - 1), seq[k + 1:]], log_p.new_zeros(k + 1)])
        out.append(depth_lp)
    return main, torch.stack(out, dim=-1) if depths else None


def reference(model, ids, mask, loss_mask):
    """The batch, sequence by sequence: main logits ``[b, s, v]``, ``mtp_log_probs [b, s, D]`` (padded back in
    place, 0 at padding) and the per-depth masked mean loss ``[D]`` (the masks by a plain loop)."""
    b, s = ids.shape
    depths = len(model.mtp.layers)
    logits = torch.zeros(b, s, model.vocab_size, device=ids.device)
    log_probs = torch.zeros(b, s, depths, device=ids.device)
    total, count = torch.zeros(depths, device=ids.device), torch.zeros(depths, device=ids.device)
    for i in range(b):
        cols = mask[i].nonzero()[:, 0]
        main, lp = reference_sequence(model, ids[i, cols])
        logits = logits.index_put((torch.full_like(cols, i), cols), main.float())
        log_probs = log_probs.index_put((torch.full_like(cols, i), cols), lp)
        n, lm = len(cols), loss_mask[i, cols]
        for k in range(1, depths + 1):
            for j in range(n):
                if j + k + 1 < n and lm[j + k]:  # target token j + k + 1, learned where the main mask is at j + k
                    total = total.index_add(0, torch.tensor([k - 1], device=ids.device), -lp[j, k - 1:k].float())
                    count[k - 1] += 1
    return logits, log_probs, total / count.clamp(min=1)


def test_loss(out, weights):
    """One scalar that reaches every output: weighted MTP log-probs, the MTP loss, and the main logits."""
    return (out["mtp_log_probs"] * weights).sum() + out["mtp_loss"].sum() + out["logits"].float().pow(2).mean()


test_loss.__test__ = False  # a helper, not a pytest test


def grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def cp_rank(rank: int, world: int, state: dict, args) -> dict:
    """A CP=2 rank: the model with ``state``'s weights, ``make_forward("thd", mtp=True)`` on this rank's zigzag
    share, outputs (every rank holds the gathered ones) and this rank's share of the gradients."""
    from megatron.core import parallel_state as ps

    from packfwd import make_forward
    from packfwd.models import build_model
    from packfwd.models.convert.hf import load_weights
    from packfwd.models.runtime import ensure_model_parallel

    ensure_model_parallel(cp_size=world)
    model = load_weights(build_model(args, attention_backend="reference", init=False), state)
    ids, mask, loss_mask, weights = batch()
    forward = make_forward("thd", mtp=True, cp_size=world, cp_rank=rank, cp_group=ps.get_context_parallel_group())
    out = forward(model, ids, mask, mtp_loss_mask=loss_mask)
    test_loss(out, weights).backward()
    result = {k: v.detach() for k, v in out.items()}
    result["grads"] = grads(model)
    ps.destroy_model_parallel()
    return result
