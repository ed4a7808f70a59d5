"""HF transformers Llama/Qwen2 <-> packfwd's Megatron-Core models: configs and weights, TP-sharded.

Weight layout (Megatron-Core's, per layer; ``ng`` query groups = kv heads, ``r = heads / ng``, ``d`` head dim)::

    linear_qkv.weight  [ng * (r + 2) * d, hidden]  for each group g: its r query heads, then k_g, then v_g
    linear_fc1.weight  [2 * ffn, hidden]           [gate; up]

A TP rank holds a contiguous block of rows of the column-parallel weights (``linear_qkv``: ``ng / tp`` whole
groups; ``linear_fc1``: ``[gate_rank; up_rank]``; the embedding and output layer: ``vocab / tp`` rows) and of
columns of the row-parallel ones (``linear_proj``, ``linear_fc2``); norms, row-parallel biases and a value head
are replicated.

:func:`hf_to_megatron` and :func:`megatron_to_hf` are pure functions on state dicts (one dict per TP rank);
:func:`from_hf` and :func:`to_hf_state_dict` apply them to modules.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch
from torch import Tensor

from .gpt import ModelArgs

__all__ = ["args_from_hf_config", "from_hf", "hf_to_megatron", "load_weights", "megatron_to_hf", "to_hf_state_dict"]

_SUPPORTED = ("llama", "qwen2")


def args_from_hf_config(hf_config, *, value_head: bool = False) -> ModelArgs:
    """:class:`ModelArgs` of a transformers ``LlamaConfig`` or ``Qwen2Config`` (``value_head``: width-1 head).

    >>> from transformers import Qwen2Config
    >>> args = args_from_hf_config(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                        num_attention_heads=4, num_key_value_heads=2, vocab_size=128))
    >>> args.num_query_groups, args.qkv_bias, args.rope_theta
    (2, True, 10000.0)
    """
    kind = getattr(hf_config, "model_type", None)
    if kind not in _SUPPORTED:
        raise ValueError(f"model_type={kind!r} is not supported; packfwd converts {_SUPPORTED}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={hf_config.hidden_act!r}: packfwd's MLP is SwiGLU (silu); use 'silu'")
    if kind == "qwen2" and getattr(hf_config, "use_sliding_window", False):
        raise ValueError("use_sliding_window=True: packfwd's attention is full causal; set it to False")
    qkv_bias, linear_bias = _biases(hf_config, kind)
    theta, factor = _rope(hf_config)
    heads = hf_config.num_attention_heads
    return ModelArgs(
        vocab_size=hf_config.vocab_size,
        hidden_size=hf_config.hidden_size,
        ffn_hidden_size=hf_config.intermediate_size,
        num_layers=hf_config.num_hidden_layers,
        num_attention_heads=heads,
        num_query_groups=getattr(hf_config, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads,
        norm_eps=hf_config.rms_norm_eps,
        rope_theta=theta,
        rope_scaling_factor=factor,
        qkv_bias=qkv_bias,
        linear_bias=linear_bias,
        tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
        max_position_embeddings=hf_config.max_position_embeddings,
        value_head=value_head,
        value_head_bias=value_head and bool(getattr(hf_config, "token_classification_bias", True)),
    )


def _biases(cfg, kind: str) -> tuple[bool, bool]:
    if kind == "qwen2":
        return True, False
    attention, mlp = bool(getattr(cfg, "attention_bias", False)), bool(getattr(cfg, "mlp_bias", False))
    if attention != mlp:
        raise ValueError(
            f"attention_bias={attention}, mlp_bias={mlp}: Megatron-Core puts a bias on all linears or on none "
            "(add_bias_linear), so both must be equal"
        )
    return False, attention


def _rope(cfg) -> tuple[float, float | None]:
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    theta = float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind == "llama3":
        expected = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if any(float(params.get(k, v)) != v for k, v in expected.items()):
            raise ValueError(f"llama3 RoPE scaling {params}: Megatron-Core supports low_freq_factor=1, "
                             "high_freq_factor=4, original_max_position_embeddings=8192 only")
        return theta, float(params["factor"])
    raise ValueError(f"rope_type={kind!r} is not supported; packfwd converts 'default' and 'llama3' RoPE")


# ----------------------------------------------------------------------------------------------- weights


def _hf_names(args: ModelArgs, i: int) -> dict[str, str]:
    p = f"model.layers.{i}."
    return {
        "q": p + "self_attn.q_proj", "k": p + "self_attn.k_proj", "v": p + "self_attn.v_proj",
        "o": p + "self_attn.o_proj", "gate": p + "mlp.gate_proj", "up": p + "mlp.up_proj",
        "down": p + "mlp.down_proj", "ln1": p + "input_layernorm.weight", "ln2": p + "post_attention_layernorm.weight",
    }


def _mg_names(local: int) -> dict[str, str]:
    p = f"decoder.layers.{local}."
    return {
        "qkv": p + "self_attention.linear_qkv", "proj": p + "self_attention.linear_proj",
        "fc1": p + "mlp.linear_fc1", "fc2": p + "mlp.linear_fc2",
        "ln1": p + "input_layernorm.weight", "ln2": p + "pre_mlp_layernorm.weight",
    }


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
        h, m = _hf_names(args, i), _mg_names(local)
        out[m["ln1"]], out[m["ln2"]] = sd[h["ln1"]].clone(), sd[h["ln2"]].clone()
        out[m["qkv"] + ".weight"] = _fuse_qkv(args, [sd[h[x] + ".weight"] for x in "qkv"], tp_size, tp_rank)
        if args.qkv_bias or args.linear_bias:
            out[m["qkv"] + ".bias"] = _fuse_qkv(args, [sd[h[x] + ".bias"] for x in "qkv"], tp_size, tp_rank)
        out[m["proj"] + ".weight"] = _shard_cols(sd[h["o"] + ".weight"], tp_size, tp_rank)
        out[m["fc1"] + ".weight"] = torch.cat([rows(sd[h["gate"] + ".weight"]), rows(sd[h["up"] + ".weight"])])
        out[m["fc2"] + ".weight"] = _shard_cols(sd[h["down"] + ".weight"], tp_size, tp_rank)
        if args.linear_bias:
            out[m["proj"] + ".bias"] = sd[h["o"] + ".bias"].clone()
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
        h, m = _hf_names(args, i), _mg_names(local)
        suffixes = ("weight", "bias") if (args.qkv_bias or args.linear_bias) else ("weight",)
        for suffix in suffixes:
            q, k, v = _split_qkv(args, [s[f"{m['qkv']}.{suffix}"] for s in shards])
            out[f"{h['q']}.{suffix}"], out[f"{h['k']}.{suffix}"], out[f"{h['v']}.{suffix}"] = q, k, v
        out[h["o"] + ".weight"] = cols(m["proj"] + ".weight")
        for suffix in ("weight", "bias") if args.linear_bias else ("weight",):
            gates, ups = zip(*(s[f"{m['fc1']}.{suffix}"].chunk(2, dim=0) for s in shards))
            out[f"{h['gate']}.{suffix}"], out[f"{h['up']}.{suffix}"] = torch.cat(gates), torch.cat(ups)
        out[h["down"] + ".weight"] = cols(m["fc2"] + ".weight")
        if args.linear_bias:
            out[h["o"] + ".bias"] = first[m["proj"] + ".bias"].clone()
            out[h["down"] + ".bias"] = first[m["fc2"] + ".bias"].clone()
        out[h["ln1"]], out[h["ln2"]] = first[m["ln1"]].clone(), first[m["ln2"]].clone()
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
                        ("ffn_hidden_size", args.ffn_hidden_size)):
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


# ----------------------------------------------------------------------------------------------- modules


def load_weights(model: torch.nn.Module, weights: Mapping[str, Tensor]) -> torch.nn.Module:
    """Copy ``weights`` into ``model``'s parameters (in place; returns ``model``).  The names must be exactly the
    model's parameter names: a missing or extra name is a ValueError, a shape mismatch too.

    >>> layer = torch.nn.Linear(2, 1)
    >>> load_weights(layer, {"weight": torch.ones(1, 2), "bias": torch.zeros(1)})(torch.ones(2)).item()
    2.0
    """
    params = dict(model.named_parameters())
    missing, extra = sorted(set(params) - set(weights)), sorted(set(weights) - set(params))
    if missing or extra:
        raise ValueError(f"weights do not match the model's parameters: missing {missing}, unexpected {extra}")
    with torch.no_grad():
        for name, p in params.items():
            w = weights[name]
            if tuple(w.shape) != tuple(p.shape):
                raise ValueError(f"{name}: weight of shape {tuple(w.shape)} for a parameter of shape {tuple(p.shape)}")
            p.copy_(w)
    return model


def from_hf(
    hf_model: torch.nn.Module,
    *,
    value_head: bool | None = None,
    device: torch.device | str | None = None,
    params_dtype: torch.dtype | None = None,
    attention_backend: str | None = None,
    tp_size: int | None = None,
    tp_rank: int | None = None,
    sequence_parallel: bool = False,
    pp_rank: int = 0,
    pp_size: int = 1,
    vpp_rank: int = 0,
    vpp_size: int = 1,
    first_stage_layers: int | None = None,
    last_stage_layers: int | None = None,
):
    """packfwd's Megatron-Core model (or pipeline stage) with the weights of a transformers ``LlamaForCausalLM``
    / ``Qwen2ForCausalLM`` (or their ``...ForTokenClassification`` with one label, as a value model).

    Works in a fresh Python process: when ``torch.distributed`` is not initialised it creates a single-process
    gloo world and Megatron-Core's model-parallel state (sizes 1) itself; under a real launcher it uses the
    existing ``megatron.core.parallel_state`` and loads this process's TP shard.  ``tp_size``/``tp_rank``, when
    given, must match that state.

    ``value_head``: None = a width-1 head exactly when the HF model has one (``score``); True on a causal LM
    gives a value model whose head keeps its random initialisation.  ``device``/``params_dtype`` default to the
    HF model's.  Pipeline arguments as in :func:`packfwd.models.build_model`.

    >>> from transformers import Qwen2Config, Qwen2ForCausalLM
    >>> hf = Qwen2ForCausalLM(Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128)).eval()
    >>> model = from_hf(hf)
    >>> ids = torch.randint(0, 128, (1, 6))
    >>> torch.allclose(model(ids, None, None), hf(ids).logits, atol=1e-5)
    True
    """
    from megatron.core import parallel_state

    from packfwd.layers import layer_partition

    from .gpt import build_model
    from .runtime import ensure_model_parallel

    has_score = hasattr(hf_model, "score")
    if value_head is None:
        value_head = has_score
    if has_score and getattr(hf_model.config, "num_labels", 1) != 1:
        raise ValueError(
            f"the HF model's score head has num_labels={hf_model.config.num_labels}; a value model needs 1"
        )
    if has_score and not value_head:
        raise ValueError("the HF model has a score (value) head; pass value_head=True or None")
    args = args_from_hf_config(hf_model.config, value_head=value_head)
    if value_head and not has_score:
        args = _replace(args, value_head_bias=False)
    first = next(hf_model.parameters())
    device = first.device if device is None else torch.device(device)
    params_dtype = first.dtype if params_dtype is None else params_dtype
    ensure_model_parallel(tp_size=tp_size)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    if tp_rank is not None and tp_rank != rank:
        raise ValueError(f"tp_rank={tp_rank} but this process is TP rank {rank}; pass tp_rank={rank} or None")
    model = build_model(
        args, device=device, params_dtype=params_dtype, attention_backend=attention_backend,
        sequence_parallel=sequence_parallel, pp_rank=pp_rank, pp_size=pp_size, vpp_rank=vpp_rank,
        vpp_size=vpp_size, first_stage_layers=first_stage_layers, last_stage_layers=last_stage_layers, init=False,
    )
    layers = layer_partition(args.num_layers, pp_size, vpp_size, first_stage_layers=first_stage_layers,
                             last_stage_layers=last_stage_layers)[pp_rank][vpp_rank]
    weights = hf_to_megatron(hf_model.state_dict(), args, tp_size=tp, tp_rank=rank, layers=layers,
                             pre_process=model.pre_process, post_process=model.post_process)
    if value_head and not has_score:  # keep the head as initialised
        weights.update({n: p.detach() for n, p in model.named_parameters() if n.startswith("output_layer.")})
    return load_weights(model, weights)


def to_hf_state_dict(model: torch.nn.Module) -> dict[str, Tensor]:
    """The HF transformers state dict of a packfwd model (its part of it, for a pipeline stage), on the
    model's device.  The model must not be TP-sharded; for TP gather every rank's ``model.state_dict()`` and
    call :func:`megatron_to_hf`.

    >>> from transformers import LlamaConfig, LlamaForCausalLM
    >>> hf = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    ...                                   num_attention_heads=4, vocab_size=128, tie_word_embeddings=True))
    >>> state = to_hf_state_dict(from_hf(hf))
    >>> sorted(state) == sorted(hf.state_dict()) and all(torch.equal(state[k], v) for k, v in hf.state_dict().items())
    True
    """
    from .gpt import model_args, unwrap

    gpt = unwrap(model)
    if gpt.config.tensor_model_parallel_size != 1:
        raise ValueError("to_hf_state_dict takes an unsharded model (TP size 1); for TP gather every rank's "
                         "state_dict and call packfwd.models.megatron_to_hf(shards, args)")
    args = model_args(gpt)
    layers = [layer.layer_number - 1 for layer in gpt.decoder.layers]
    shard = {n: p.detach() for n, p in gpt.named_parameters()}
    return megatron_to_hf([shard], args, layers=layers, pre_process=gpt.pre_process, post_process=gpt.post_process)


def _replace(args: ModelArgs, **changes) -> ModelArgs:
    from dataclasses import replace

    return replace(args, **changes)
