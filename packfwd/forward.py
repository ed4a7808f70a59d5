"""The forward factory: a padded (or jagged) batch in, the padded model's outputs out, computed packed.

``make_forward(data_format)`` returns a pure function ``forward(model, input_ids, attention_mask, ...)``:

* ``"thd"``: ``to_thd -> model(packed_seq_params=...) -> from_thd``.  The batch becomes one packed row
  ``[1, t]``; attention runs per sequence on ``cu_seqlens_padded``; nothing is computed for padding.
* ``"bshd"``: ``to_bshd -> model -> from_bshd``.  Each row's real tokens are moved left into ``[b, s_c]``
  (``s_c`` the longest row); causal attention over a row then never sees its padding.

Without a logits processor it returns the logits ``[b, s, v]`` (``v_local`` under tensor parallelism) in the
caller's layout, zeros at padding; a value model's ``[b, s]``.  With one, ``processor(logits [t, v_local],
**packed_args) -> dict[str, Tensor [t, ...]]`` runs on the packed logits and every output comes back as
``[b, s, ...]``.  Processor arguments are packed the same way as the logits: a ``[b, s, ...]`` tensor token by
token, a ``[b]`` tensor (a per-sequence value such as a temperature) is given to each of its sequence's tokens;
anything else (a float, a 0-d tensor, a process group) is passed unchanged.  A jagged nested ``input_ids``
(``torch.nested``, ``layout=torch.jagged``, ``attention_mask=None``) gives jagged outputs, and its
per-token processor arguments are jagged too.

Pipeline parallelism: a stage without the output layer (``post_process=False``) returns its hidden states as
the model produced them (``[t, 1, h]`` for THD, ``[s_c, b, h]`` for BSHD), for the next stage's
``set_input_tensor``; only the last stage applies the processor and unpacks.

Vision models: with ``vision=True`` the entries of ``multi_modal_inputs`` (``pixel_values``,
``image_grid_thw``, ``pixel_values_videos``, ``video_grid_thw``, ...) go to the model as keyword arguments and
the model embeds the (packed) tokens and images itself; packfwd packs ids and positions only.
"""

from __future__ import annotations

from typing import Callable, Mapping

import torch
from torch import Tensor

from .bshd import from_bshd, to_bshd
from .thd import from_thd, plan_thd, position_ids as thd_position_ids, to_thd

__all__ = ["make_forward"]

_FORMATS = ("thd", "bshd")


def make_forward(
    data_format: str = "thd",
    *,
    vision: bool = False,
    logits_processor: Callable[..., Mapping[str, Tensor]] | None = None,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int = 0,
    cp_group=None,
    seq_align: int | None = None,
    check_group=None,
) -> Callable:
    """A pure ``forward(model, input_ids, attention_mask, position_ids=None, multi_modal_inputs=None, *,
    seqlens=None, **processor_args)`` (see the module docstring).

    ``seqlens``: the real length of every row as host ints (a list, or a CPU tensor), when the caller knows them
    (an RL trainer does): the plan is then made with no host sync, and the whole forward makes none.  Without
    it the plan reads the lengths back from the device once.

    ``tp_size``: the tensor-parallel size when the model uses sequence parallelism (packed lengths must divide by
    it); ``cp_size``/``cp_rank``/``cp_group``: context parallelism (THD only): each rank packs its zigzag share,
    and the outputs of all CP ranks are all-gathered over ``cp_group`` to unpack them (the gather's backward keeps
    this rank's share of the gradient: every rank must compute the same loss from the unpacked outputs).
    ``seq_align``: per-sequence alignment of ``plan_thd``.

    ``check_group``: a process group whose ranks must all get the same batch (e.g. Megatron-Core's
    tensor-and-context-parallel group).  With it, each call validates its inputs and plans the packing on every
    rank, then compares the outcome across the group (``packfwd.parallel.check_across_ranks``: one all-gather of a
    few integers and a host sync) before the model runs: a rank with bad or different inputs makes every rank
    raise the same error, where otherwise the others would wait for it in the model's collectives.

    >>> import torch
    >>> class Toy(torch.nn.Module):        # one-hot "logits" of the input ids, under any packing
    ...     def forward(self, input_ids, position_ids, attention_mask, packed_seq_params=None):
    ...         return torch.nn.functional.one_hot(input_ids, 5).float()
    >>> ids = torch.tensor([[0, 3, 4], [2, 0, 0]]); mask = torch.tensor([[0, 1, 1], [1, 0, 0]])
    >>> make_forward("thd")(Toy(), ids, mask).argmax(-1).tolist()
    [[0, 3, 4], [2, 0, 0]]
    >>> def hit(logits, labels):                 # a logits processor: [t, v], [t] -> {name: [t]}
    ...     return {"hit": logits[torch.arange(len(labels)), labels]}
    >>> make_forward("bshd", logits_processor=hit)(Toy(), ids, mask, labels=ids)["hit"].tolist()
    [[0.0, 1.0, 1.0], [1.0, 0.0, 0.0]]
    """
    if data_format not in _FORMATS:
        raise ValueError(f"data_format={data_format!r}; pass one of {_FORMATS}")
    if logits_processor is not None and not callable(logits_processor):
        raise TypeError("logits_processor must be callable: processor(logits [t, v], **packed_args) -> dict")
    for name, value in (("tp_size", tp_size), ("cp_size", cp_size)):
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be a positive int, got {value!r}")
    if cp_size > 1 and data_format != "thd":
        raise ValueError("context parallelism needs data_format='thd'")
    if cp_size > 1 and cp_group is None:
        raise ValueError("cp_size > 1 needs cp_group (to gather every CP rank's outputs); pass the CP process group")
    if not 0 <= cp_rank < cp_size:
        raise ValueError(f"cp_rank={cp_rank} must lie in [0, cp_size={cp_size})")
    layout = _Thd(tp_size, cp_size, cp_rank, cp_group, seq_align) if data_format == "thd" else _Bshd(tp_size)

    def forward(model, input_ids, attention_mask=None, position_ids=None, multi_modal_inputs=None, *,
                seqlens=None, **processor_args):
        if processor_args and logits_processor is None:
            raise TypeError(f"got processor arguments {sorted(processor_args)} but no logits_processor")
        if multi_modal_inputs and not vision:
            raise ValueError("multi_modal_inputs given to a text forward; build it with make_forward(..., vision=True)")
        error = None
        try:
            _check_model(model, tp_size, cp_size)
            plan, ids = layout.pack(input_ids, attention_mask, seqlens)
            args = {k: layout.pack_arg(v, plan, input_ids) for k, v in processor_args.items()}
        except (ValueError, TypeError) as exc:
            if check_group is None:
                raise
            error = exc
        if check_group is not None:
            from .parallel.checks import check_across_ranks

            fingerprint = () if error is not None else layout.fingerprint(plan)
            check_across_ranks(check_group, error=error, values=fingerprint, what="batches")
        positions = layout.positions(plan, ids, position_ids)
        extra = dict(multi_modal_inputs or {})
        out = model(input_ids=ids, position_ids=positions, attention_mask=None,
                    **layout.model_kwargs(plan), **extra)
        if not getattr(_unwrap(model), "post_process", True):
            return out  # a middle pipeline stage: hidden states for the next one
        logits = layout.tokens(out, plan)  # [t, v]
        if logits_processor is None:
            full = layout.unpack(logits, plan)
            return full.squeeze(-1) if _is_value_model(model) else full
        results = logits_processor(logits, **args)
        if not isinstance(results, Mapping):
            raise TypeError(f"logits_processor must return a dict of [t, ...] tensors, got {type(results).__name__}")
        return {k: layout.unpack(v, plan) for k, v in results.items()}

    return forward


# ----------------------------------------------------------------------------------------------- layouts


class _Thd:
    def __init__(self, tp_size, cp_size, cp_rank, cp_group, seq_align):
        self.kw = dict(tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank, seq_align=seq_align)
        self.cp_group = cp_group

    def pack(self, input_ids, attention_mask, seqlens=None):
        info = plan_thd(attention_mask, x=input_ids, seqlens=seqlens, **self.kw)
        if info.cp_size > 1 and info.max_seqlen * info.cp_size == info.total_tokens:
            # Megatron-Core's THD RoPE takes a table of max_seqlen * cp_size rows whose length equals the packed
            # total as "one row per packed token" and offsets each sequence's positions by its start; report
            # a larger max_seqlen (still valid: an upper bound, a multiple of 2*cp) so the table means "positions
            # 0, 1, ..." of each sequence.
            bumped = info.max_seqlen + 2 * info.cp_size
            info = plan_thd(attention_mask, x=input_ids, max_seqlen=bumped, seqlens=seqlens, **self.kw)
        ids, _ = to_thd(input_ids, info)
        return info, ids[None]  # [1, t]

    def positions(self, info, ids, position_ids):
        if position_ids is None:
            return thd_position_ids(info)[None]
        if position_ids.dim() == 3:  # [k, b, s] (multimodal RoPE) -> [k, 1, t]
            packed, _ = to_thd(position_ids.permute(1, 2, 0), info)
            return packed.permute(1, 0)[:, None]
        return to_thd(position_ids, info)[0][None]

    def model_kwargs(self, info):
        return {"packed_seq_params": info.packed_seq_params()}

    def fingerprint(self, info):
        """Host ints every rank of a TP/CP group must agree on (no device sync)."""
        return (info.batch_size, info.seq_len, info.source.total, info.total_tokens, info.max_seqlen)

    def tokens(self, out, info):
        return out.reshape(info.local_tokens, *out.shape[2:])  # [1, t, v] -> [t, v]

    def pack_arg(self, value, info, input_ids):
        return _pack_arg(value, input_ids, lambda x: to_thd(x, info)[0], info.source)

    def unpack(self, y, info):
        if info.cp_size > 1:
            return from_thd(list(_GatherCp.apply(y, self.cp_group, info.cp_size, info.cp_rank)), info)
        return from_thd(y, info)


class _Bshd:
    def __init__(self, tp_size):
        self.tp_size = tp_size

    def pack(self, input_ids, attention_mask, seqlens=None):
        ids, info = to_bshd(input_ids, attention_mask, tp_size=self.tp_size, seqlens=seqlens)
        return info, ids  # [b, s_c]

    def positions(self, info, ids, position_ids):
        if position_ids is None:
            return torch.arange(info.width, device=ids.device).expand(ids.shape[0], info.width)
        if position_ids.dim() == 3:  # [k, b, s] -> [k, b, s_c]
            return to_bshd(position_ids.permute(1, 2, 0), info)[0].permute(2, 0, 1)
        return to_bshd(position_ids, info)[0]

    def model_kwargs(self, info):
        return {}

    def fingerprint(self, info):
        return (info.source.batch_size, info.source.seq_len, info.source.total, info.width)

    def tokens(self, out, info):
        return out.reshape(-1, *out.shape[2:])  # [b, s_c, v] -> [b*s_c, v]

    def pack_arg(self, value, info, input_ids):
        return _pack_arg(value, input_ids, lambda x: to_bshd(x, info)[0].reshape(-1, *x.shape[2:]), info.source)

    def unpack(self, y, info):
        b = info.source.batch_size
        return from_bshd(y.reshape(b, info.width, *y.shape[1:]), info)


def _pack_arg(value, input_ids, pack, source):
    """A processor argument in the packed layout (rules in the module docstring)."""
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    b = source.batch_size
    if input_ids.is_nested:
        if value.is_nested:
            return pack(value)
        if value.dim() == 1 and value.shape[0] == b:  # per sequence -> per token, jagged like input_ids
            token = torch.arange(source.total, device=value.device)
            seq = torch.searchsorted(source.cu_seqlens[1:].to(value.device), token, right=True)
            return pack(torch.nested.nested_tensor_from_jagged(value[seq], source.nested_offsets.to(value.device)))
    else:
        s = input_ids.shape[1]
        if value.dim() >= 2 and tuple(value.shape[:2]) == (b, s):
            return pack(value)
        if value.dim() == 1 and value.shape[0] == b:
            return pack(value[:, None].expand(b, s))
    raise ValueError(
        f"a processor argument has shape {tuple(value.shape)}; give per-token values like input_ids ([b, s, ...], or "
        f"jagged), per-sequence values as [b={b}], or a scalar"
    )


class _GatherCp(torch.autograd.Function):
    """All-gather this rank's packed output over the CP group; the backward keeps this rank's slice of the
    gradient (every rank computes the same downstream loss from the gathered outputs)."""

    @staticmethod
    def forward(ctx, y, group, cp_size, cp_rank):
        ctx.cp_rank = cp_rank
        parts = [torch.empty_like(y) for _ in range(cp_size)]
        torch.distributed.all_gather(parts, y.contiguous(), group=group)
        return tuple(parts)

    @staticmethod
    def backward(ctx, *grads):
        return grads[ctx.cp_rank], None, None, None


# ----------------------------------------------------------------------------------------------- model facts


def _unwrap(model):
    depth = 0
    while hasattr(model, "module") and isinstance(model.module, torch.nn.Module) and depth < 8:
        model, depth = model.module, depth + 1
    return model


def _is_value_model(model) -> bool:
    from .models.gpt import ValueHead  # imports no Megatron-Core

    return isinstance(getattr(_unwrap(model), "output_layer", None), ValueHead)


def _check_model(model, tp_size: int, cp_size: int) -> None:
    config = getattr(_unwrap(model), "config", None)
    if config is None:
        return
    if getattr(config, "sequence_parallel", False) and getattr(config, "tensor_model_parallel_size", 1) != tp_size:
        raise ValueError(f"the model is sequence parallel over {config.tensor_model_parallel_size} ranks; pass "
                         f"tp_size={config.tensor_model_parallel_size} to make_forward")
    cp = getattr(config, "context_parallel_size", 1)
    if cp != cp_size:
        raise ValueError(f"the model's context_parallel_size is {cp}; pass cp_size={cp} (and cp_rank, cp_group)")
