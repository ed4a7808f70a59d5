"""HF transformers state dicts <-> packfwd's Megatron-Core state dicts, TP-sharded: pure functions, the small engine
that applies a family's mapping (:mod:`packfwd.models.families`).

Per layer it applies the family entry's own rows (``Family.layer_weights``: the layer norms) and asks the layer's
components (:mod:`packfwd.models.component`: its token mixer and its MLP) for theirs, which are declarative tables
(:mod:`packfwd.models.mapping`: each row a Megatron-Core tensor, its HF tensor(s) and its TP cut) but for the routed
experts (:mod:`packfwd.models.mlp.moe_weights`).  The model's own tensors stay here: the embedding and the output
layer (``vocab / tp`` rows each; tied embeddings, a value head's ``score``), the final norm (replicated).  A model
with an MTP layer (``args.mtp_num_layers``, on the last stage) converts it too where its family has an MTP mapping
(``Family.mtp_weights``: Qwen3.5's and Qwen3-Next's ``mtp.*`` tensors; the inner layer is a decoder layer's
table), and refuses otherwise.

A TP rank holds a contiguous block of rows of the column-parallel weights and of columns of the row-parallel ones;
norms, row-parallel biases and a value head are replicated.  :func:`hf_to_megatron` and :func:`megatron_to_hf`
work on state dicts (one dict per TP rank); :mod:`packfwd.models.convert.hf` applies them to modules.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from ..args import ModelArgs
from ..families import family
from ..mapping import rows_to_hf, rows_to_megatron
from ..mixers import mixers
from ..mlp import DENSE

__all__ = ["hf_to_megatron", "megatron_to_hf"]


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
    ``score.bias``) as its output layer.  With ``args.mtp_num_layers`` the last stage also takes the MTP layer
    from the ``mtp.*`` tensors of ``hf_state_dict`` (its family's MTP mapping; ValueError for a family without one)
    and a copy of the embedding.  Returns new tensors (slices are copied).

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
    mtp = post_process and args.mtp_num_layers > 0
    if pre_process or mtp:  # the last stage of an MTP model holds a copy of the embedding (Megatron-Core's rule)
        out["embedding.word_embeddings.weight"] = rows(sd["model.embed_tokens.weight"])
    entry = family(args.family)
    for local, i in enumerate(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out.update(rows_to_megatron(entry.layer_weights, args, sd, h, m, tp_size, tp_rank))
        for component in entry.components(args, i):
            out.update(component.hf_to_megatron(args, sd, h, m, tp_size=tp_size, tp_rank=tp_rank))
    if post_process:
        out["decoder.final_layernorm.weight"] = sd["model.norm.weight"].clone()
        if args.value_head:
            for name in ("weight", "bias") if args.value_head_bias else ("weight",):
                if f"score.{name}" in sd:
                    out[f"output_layer.{name}"] = sd[f"score.{name}"].clone()
        elif not (args.tie_embeddings and pre_process):
            source = "model.embed_tokens.weight" if args.tie_embeddings else "lm_head.weight"
            out["output_layer.weight"] = rows(sd[source])
    if mtp:
        out.update(_mtp_to_megatron(sd, args, entry, tp_size, tp_rank))
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
    HF's own state dict; with ``args.mtp_num_layers`` the last stage gives the checkpoint's ``mtp.*`` tensors too.
    Returns new tensors.

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

    out: dict[str, Tensor] = {}
    first = shards[0]
    if pre_process:
        out["model.embed_tokens.weight"] = rows("embedding.word_embeddings.weight")
    entry = family(args.family)
    for local, i in enumerate(layers):
        h, m = f"model.layers.{i}.", f"decoder.layers.{local}."
        out.update(rows_to_hf(entry.layer_weights, args, shards, m, h))
        for component in entry.components(args, i):
            out.update(component.megatron_to_hf(args, shards, m, h))
    if post_process:
        out["model.norm.weight"] = first["decoder.final_layernorm.weight"].clone()
        if args.value_head:
            for name in ("weight", "bias") if args.value_head_bias else ("weight",):
                out[f"score.{name}"] = first[f"output_layer.{name}"].clone()
        elif args.tie_embeddings and pre_process:
            out["lm_head.weight"] = out["model.embed_tokens.weight"].clone()
        else:
            out["lm_head.weight"] = rows("output_layer.weight")
        if args.mtp_num_layers:
            out.update(_mtp_to_hf(shards, args, entry))
    return out


def _mtp_layer(args: ModelArgs, entry) -> tuple[str, str]:
    """The MTP layer's inner decoder layer's prefixes (HF, Megatron-Core); ValueError, naming the fix, for a model
    whose MTP layers packfwd does not convert.  Its own weights are the family's ``mtp_weights`` (HF under ``mtp.``,
    Megatron-Core under ``mtp.layers.0.``); the inner layer is converted as the decoder's global layer
    ``num_layers`` (the layer its spec builds), under ``mtp.layers.0.`` and ``mtp.layers.0.<inner>.``."""
    from ..runtime.mtp import inner_layer_name

    entry.check_mtp(args.mtp_num_layers, f"mtp_num_layers={args.mtp_num_layers}")
    return "mtp.layers.0.", f"mtp.layers.0.{inner_layer_name()}."


def _mtp_to_megatron(sd, args: ModelArgs, entry, tp: int, rank: int) -> dict[str, Tensor]:
    h, m = _mtp_layer(args, entry)
    out = rows_to_megatron(entry.mtp_weights, args, sd, "mtp.", "mtp.layers.0.", tp, rank)
    out.update(rows_to_megatron(entry.layer_weights, args, sd, h, m, tp, rank))
    for component in entry.components(args, args.num_layers):
        out.update(component.hf_to_megatron(args, sd, h, m, tp_size=tp, tp_rank=rank))
    return out


def _mtp_to_hf(shards, args: ModelArgs, entry) -> dict[str, Tensor]:
    h, m = _mtp_layer(args, entry)
    out = rows_to_hf(entry.mtp_weights, args, shards, "mtp.layers.0.", "mtp.")
    out.update(rows_to_hf(entry.layer_weights, args, shards, m, h))
    for component in entry.components(args, args.num_layers):
        out.update(component.megatron_to_hf(args, shards, m, h))
    return out


def _check_tp(args: ModelArgs, tp_size: int, tp_rank: int) -> None:
    if not isinstance(tp_size, int) or tp_size < 1 or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_size={tp_size!r}, tp_rank={tp_rank!r}: need 0 <= tp_rank < tp_size")
    widths = (w for m in mixers(args) for w in m.tp_widths(args))
    for name, value in (("vocab_size", args.vocab_size), *widths, *DENSE.tp_widths(args)):
        if value % tp_size:
            raise ValueError(f"{name}={value} is not divisible by tp_size={tp_size}; pick a tp_size that divides it")


def _shard_rows(tp: int, rank: int):
    return lambda x: x.chunk(tp, dim=0)[rank].clone()
