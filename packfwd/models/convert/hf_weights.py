"""HF transformers state dicts <-> packfwd's Megatron-Core state dicts, TP-sharded: pure functions, for the
families of :mod:`packfwd.models.families.family` (the names below; a layer's non-dense MLP is converted by its MLP kind).

Weight layout (Megatron-Core's, per layer; ``ng`` query groups = kv heads, ``r = heads / ng``, ``d`` head dim)::

    linear_qkv.weight  [ng * (r + 2) * d, hidden]  for each group g: its r query heads, then k_g, then v_g
    q_layernorm.weight [d]                         QK-norm (Qwen3's self_attn.q_norm; k_layernorm: k_norm)
    linear_fc1.weight  [2 * ffn, hidden]           [gate; up]

A layer with multi-head latent attention (``args.mla``, DeepSeek-V3) has :mod:`packfwd.models.mixers.mla_weights`'s attention
weights instead of ``linear_qkv`` / ``linear_proj``.

A TP rank holds a contiguous block of rows of the column-parallel weights (``linear_qkv``: ``ng / tp`` whole
groups; ``linear_fc1``: ``[gate_rank; up_rank]``; the embedding and output layer: ``vocab / tp`` rows) and of
columns of the row-parallel ones (``linear_proj``, ``linear_fc2``); norms (QK-norms too: every head has the same
one), row-parallel biases and a value head are replicated.  :func:`hf_to_megatron` and :func:`megatron_to_hf`
work on state dicts (one dict per TP rank); :mod:`packfwd.models.convert.hf` applies them to modules.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..args import ModelArgs
from ..families.family import mlp_kind
from ..mixers.mla_weights import mla_from_hf, mla_to_hf
from ..mixers.latent import mla_tp_widths

__all__ = ["hf_to_megatron", "megatron_to_hf"]


def _hf_names(i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "layer": p, "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
        "o": p + "self_attn.o_proj", "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj",
        "down": p + "mlp.down_proj", "ln1": p + "input_layernorm.weight", "ln2": p + "post_attention_layernorm.weight",
        "q_norm": p + "self_attn.q_norm.weight", "k_norm": p + "self_attn.k_norm.weight",
    }


def _mg_names(local: int) -> dict[str, str]:
    p = f"decoder.layers.{local}."
    return {
        "layer": p, "qkv": p + "self_attention.linear_qkv", "proj": p + "self_attention.linear_proj",
        "fc1": p + "mlp.linear_fc1", "fc2": p + "mlp.linear_fc2",
        "ln1": p + "input_layernorm.weight", "ln2": p + "pre_mlp_layernorm.weight",
        "q_norm": p + "self_attention.q_layernorm.weight", "k_norm": p + "self_attention.k_layernorm.weight",
    }


def _norms(args: ModelArgs) -> tuple[str, ...]:
    """The replicated norm weights of a layer (keys of :func:`_hf_names` / :func:`_mg_names`)."""
    return ("ln1", "ln2", "q_norm", "k_norm") if args.qk_norm else ("ln1", "ln2")


def hf_to_megatron(
    hf_state_dict: Mapping[str, Tensor],
    args: ModelArgs,
    *,
    tp_size: int = 1,
    tp_rank: int = 0,
    layers: Sequence[int] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> dict[str, Tensor]:
    """TP rank ``tp_rank``'s Megatron-Core state dict (parameters only) from an HF state dict.

    ``layers``: the global layers the target model holds (a pipeline stage's range; default all); they become
    ``decoder.layers.0 ...`` in order.  ``pre_process``/``post_process``: whether it has the embedding / the
    final norm and output layer.  A value model (``args.value_head``) takes ``score.weight`` (and
    ``score.bias``) as its output layer.  Returns new tensors (slices are copied).

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> from packfwd.models.convert.hf import args_from_hf_config
    >>> hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    >>> args = args_from_hf_config(hf.config)
    >>> shard = hf_to_megatron(hf.state_dict(), args, tp_size=2, tp_rank=1)
    >>> tuple(shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape)  # 1 group of (2 q + k + v) x 16
    (64, 64)
    >>> back = megatron_to_hf([hf_to_megatron(hf.state_dict(), args, tp_size=2, tp_rank=r) for r in (0, 1)], args)
    >>> all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    True
    """
    _check_tp(args, tp_size, tp_rank)
    layers = range(args.num_layers) if layers is None else layers
    sd = hf_state_dict
    out: dict[str, Tensor] = {}
    rows = _shard_rows(tp_size, tp_rank)
    if pre_process:
        out["embedding.word_embeddings.weight"] = rows(sd["model.embed_tokens.weight"])
    for local, i in enumerate(layers):
        h, m = _hf_names(i), _mg_names(local)
        out.update({m[n]: sd[h[n]].clone() for n in _norms(args)})
        if args.mla is not None:  # multi-head latent attention (hf_mla.py)
            out.update(mla_from_hf(sd, h["layer"] + "self_attn.", m["layer"] + "self_attention.", args.mla,
                                   tp_size=tp_size, tp_rank=tp_rank))
        else:
            out[m["qkv"] + ".weight"] = _fuse_qkv(args, [sd[h[x] + ".weight"] for x in "qkv"], tp_size, tp_rank)
            if args.qkv_bias or args.linear_bias:
                out[m["qkv"] + ".bias"] = _fuse_qkv(args, [sd[h[x] + ".bias"] for x in "qkv"], tp_size, tp_rank)
            out[m["proj"] + ".weight"] = _shard_cols(sd[h["o"] + ".weight"], tp_size, tp_rank)
            if args.linear_bias:
                out[m["proj"] + ".bias"] = sd[h["o"] + ".bias"].clone()
        if not args.dense_mlp(i):
            out.update(mlp_kind(args.moe).hf_to_megatron(args, sd, h["layer"], m["layer"], tp_size=tp_size,
                                                         tp_rank=tp_rank))
            continue
        out[m["fc1"] + ".weight"] = torch.cat([rows(sd[h["gate"] + ".weight"]), rows(sd[h["up"] + ".weight"])])
        out[m["fc2"] + ".weight"] = _shard_cols(sd[h["down"] + ".weight"], tp_size, tp_rank)
        if args.linear_bias:
            out[m["fc1"] + ".bias"] = torch.cat([rows(sd[h["gate"] + ".bias"]), rows(sd[h["up"] + ".bias"])])
            out[m["fc2"] + ".bias"] = sd[h["down"] + ".bias"].clone()
    if post_process:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        if args.value_head:
            for name in ("weight", "bias") if args.value_head_bias else ("weight",):
                if f"score.{name}" in sd:
                    out[f"output_layer.{name}"] = sd[f"score.{name}"].clone()
        elif not (args.tie_embeddings and pre_process):
            source = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
            out["output_layer.weight"] = rows(sd[source])
    return out


def megatron_to_hf(
    shards: Sequence[Mapping[str, Tensor]],
    args: ModelArgs,
    *,
    layers: Sequence[int] | None = None,
    pre_process: bool = True,
    post_process: bool = True,
) -> dict[str, Tensor]:
    """The inverse of :func:`hf_to_megatron`: HF tensors from the state dicts of all TP ranks, in rank order.

    For a pipeline stage (``layers``, ``pre_process``, ``post_process`` as in :func:`hf_to_megatron`) the result
    holds that stage's part of the HF state dict.  With tied embeddings ``lm_head.weight`` is the embedding, as in
    HF's own state dict.  Returns new tensors.

    >>> import torch
    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> from packfwd.models.convert.hf import args_from_hf_config
    >>> hf = Qwen2ForCausalLM(Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
    ...                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=64))
    >>> args = args_from_hf_config(hf.config)
    >>> shards = [hf_to_megatron(hf.state_dict(), args, tp_size=2, tp_rank=r) for r in (0, 1)]
    >>> back = megatron_to_hf(shards, args)
    >>> torch.equal(back["model.layers.0.self_attn.q_proj.bias"], hf.model.layers[0].self_attn.q_proj.bias)
    True
    """
    if not shards:
        raise ValueError("shards is empty; pass one state dict per TP rank, in rank order")
    tp = len(shards)
    _check_tp(args, tp, 0)
    layers = range(args.num_layers) if layers is None else layers

    def rows(name):
        return torch.cat([s[name] for s in shards], dim=0)

    def cols(name):
        return torch.cat([s[name] for s in shards], dim=1)

    out: dict[str, Tensor] = {}
    first = shards[0]
    if pre_process:
        out["model.embed_tokens.weight"] = rows("embedding.word_embeddings.weight")
    for local, i in enumerate(layers):
        h, m = _hf_names(i), _mg_names(local)
        if args.mla is not None:
            out.update(mla_to_hf(shards, h["layer"] + "self_attn.", m["layer"] + "self_attention.", args.mla))
        else:
            for suffix in ("weight", "bias") if (args.qkv_bias or args.linear_bias) else ("weight",):
                q, k, v = _split_qkv(args, [s[f"{m['qkv']}.{suffix}"] for s in shards])
                out[f"{h['q']}.{suffix}"], out[f"{h['k']}.{suffix}"], out[f"{h['v']}.{suffix}"] = q, k, v
            out[h["o"] + ".weight"] = cols(m["proj"] + ".weight")
            if args.linear_bias:
                out[h["o"] + ".bias"] = first[m["proj"] + ".bias"].clone()
        if args.dense_mlp(i):
            for suffix in ("weight", "bias") if args.linear_bias else ("weight",):
                gates, ups = zip(*(s[f"{m['fc1']}.{suffix}"].chunk(2, dim=0) for s in shards))
                out[f"{h['gate']}.{suffix}"], out[f"{h['up']}.{suffix}"] = torch.cat(gates), torch.cat(ups)
            out[h["down"] + ".weight"] = cols(m["fc2"] + ".weight")
            if args.linear_bias:
                out[h["down"] + ".bias"] = first[m["fc2"] + ".bias"].clone()
        else:
            out.update(mlp_kind(args.moe).megatron_to_hf(args, shards, m["layer"], h["layer"]))
        out.update({h[n]: first[m[n]].clone() for n in _norms(args)})
    if post_process:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
        if args.value_head:
            for name in ("weight", "bias") if args.value_head_bias else ("weight",):
                out[f"score.{name}"] = first[f"output_layer.{name}"].clone()
        elif args.tie_embeddings and pre_process:
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        else:
            out["lm_head.weight"] = rows("output_layer.weight")
    return out


def _check_tp(args: ModelArgs, tp_size: int, tp_rank: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1 or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_size={tp_size!r}, tp_rank={tp_rank!r}: need 0 <= tp_rank < tp_size")
    for name, value in (("vocab_size", args.vocab_size), ("num_query_groups", args.query_groups),
                        ("ffn_hidden_size", args.ffn_hidden_size), *mla_tp_widths(args.mla)):
        if value % tp_size:
            raise ValueError(f"{name}={value} is not divisible by tp_size={tp_size}; pick a tp_size that divides it")


def _shard_rows(tp: int, rank: int):
    return lambda x: x.chunk(tp, dim=0)[rank].clone()


def _shard_cols(x: Tensor, tp: int, rank: int) -> Tensor:
    return x.chunk(tp, dim=1)[rank].clone()


def _fuse_qkv(args: ModelArgs, qkv: list[Tensor], tp: int, rank: int) -> Tensor:
    """[q; k; v] (HF, heads contiguous) -> rank's rows of Megatron's per-group [q heads, k, v] layout."""
    q, k, v = qkv
    ng, d = args.query_groups, args.kv_channels
    trail = q.shape[1:]
    fused = torch.cat([q.reshape(ng, -1, *trail), k.reshape(ng, d, *trail), v.reshape(ng, d, *trail)], dim=1)
    return fused.chunk(tp, dim=0)[rank].reshape(-1, *trail).clone()


def _split_qkv(args: ModelArgs, shards: list[Tensor]) -> tuple[Tensor, Tensor, Tensor]:
    ng, d = args.query_groups, args.kv_channels
    r = args.num_attention_heads // ng
    fused = torch.cat(shards, dim=0)
    trail = fused.shape[1:]
    grouped = fused.reshape(ng, (r + 2) * d, *trail)
    q, k, v = grouped.split([r * d, d, d], dim=1)
    return (q.reshape(-1, *trail).clone(), k.reshape(-1, *trail).clone(), v.reshape(-1, *trail).clone())
