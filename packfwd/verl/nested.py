"""``gptmodel_forward_model_engine``: verl's forward for jagged nested batches, with packfwd's transforms inside.

Signature and results of verl 0.9.1's ``verl.models.mcore.model_forward.gptmodel_forward_model_engine`` (named
``gptmodel_forward_no_padding`` in earlier verl).  ``input_ids`` is a jagged nested tensor ``[b, j]``
(``torch.nested``, ``layout=torch.jagged``); outputs are jagged like it.

* ``data_format="thd"``: packed into ``[1, t]`` in verl's layout (each sequence padded to ``2*tp*cp``, or ``tp``
  without CP; the last one further to ``pad_to_length_bucket``; the CP zigzag split), with verl's
  ``PackedSeqParams``; the model computes positions itself (``position_ids=None``, as in verl).
* ``data_format="bshd"``: padded into ``[b, w]`` (``w``: ``forced_max_seqlen`` or the longest sequence, rounded
  up to ``2*tp*cp``, or ``tp``); under CP each row is cut into ``2*cp`` chunks and this rank keeps chunks ``r`` and
  ``2*cp-1-r``.  The model gets the ids, the padding mask ``[b, w/cp]`` (True at real tokens) and positions.

Processor arguments are jagged like ``input_ids`` and packed the same way; ``"label"`` is first replaced by each
token's next token *in its own sequence* (0 at each sequence's last token), ``"loss_mask"`` and
``"response_attention_mask"`` are not passed on (verl pops them; packfwd leaves the caller's dict alone).
Differences from verl: ``docs/VERL.md``.
"""

from __future__ import annotations

import math
from typing import Callable, Mapping

import torch
from torch import Tensor

from packfwd import from_bshd, from_thd, plan_bshd, to_bshd, to_thd

from ._common import (Parallel, gather_cp, model_facts, multimodal_kwargs, plan_verl_thd, read_parallel,
                      run_and_unpack, verl_packed_seq_params)
from .mtp import check_mtp_model, engine_loss_mask, mtp_call, mtp_targets

__all__ = ["gptmodel_forward_model_engine"]

_FORMATS = ("thd", "bshd")
_NOT_PASSED = ("loss_mask", "response_attention_mask")  # read by verl's MTP only


def gptmodel_forward_model_engine(
    model: torch.nn.Module,
    input_ids: Tensor,
    multi_modal_inputs: Mapping[str, Tensor] | None,
    logits_processor: Callable | None = None,
    logits_processor_args: Mapping | None = None,
    value_model: bool = False,
    vision_model: bool = False,
    pad_token_id: int | None = None,
    data_format: str = "thd",
    mtp_enable_train: bool = False,
    local_cp_size: int | None = None,
    forced_max_seqlen: int | None = None,
    pad_to_length_bucket: int | None = None,
    cp_layout: str = "zigzag",
    router_padding_mask: Tensor | None = None,
    mtp_loss_normalization_factor: float | None = None,
):
    """verl's nested-tensor forward (see the module docstring).

    ``pad_to_length_bucket`` (THD): the padded token total becomes a multiple of it.  ``forced_max_seqlen``
    (BSHD): the width before alignment, at least the longest sequence.  ``local_cp_size``: dynamic CP (needs a
    Megatron-Core that has it).  ``cp_layout``: ``"zigzag"`` (``"contiguous"`` only without CP).
    ``vision_model``: the model gets the ids padded with ``pad_token_id`` and their mask.  ``router_padding_mask``
    is passed to the model as ``padding_mask`` (THD).  ``mtp_enable_train=True`` (a packfwd model with MTP layers):
    the MTP loss of ``label`` and ``loss_mask`` (verl's), each depth read within its own sequence, hung on the
    backward as verl's model does (``packfwd.verl.mtp``).

    >>> import torch
    >>> from packfwd.models.runtime import ensure_model_parallel
    >>> from packfwd.testing import OneHotModel as Toy   # one-hot "logits" of the ids, under any packing
    >>> ensure_model_parallel()               # verl's workers initialise Megatron's parallel state
    >>> ids = torch.nested.nested_tensor([torch.tensor([3, 4]), torch.tensor([2, 1, 4])], layout=torch.jagged)
    >>> gptmodel_forward_model_engine(Toy(), ids, {}).argmax(-1).values().tolist()
    [3, 4, 2, 1, 4]
    >>> def processor(logits, label):         # verl's shapes: [1, t, v], [1, t]
    ...     return {"label": label, "logit": logits.gather(-1, label[..., None])[..., 0]}
    >>> out = gptmodel_forward_model_engine(Toy(), ids, {}, logits_processor=processor,
    ...                                     logits_processor_args={"label": ids})
    >>> out["label"].values().tolist()        # the next token of the same sequence, 0 at each last token
    [4, 0, 1, 4, 0]
    """
    if data_format not in _FORMATS:
        raise ValueError(f"data_format={data_format!r}; pass one of {_FORMATS}")
    if cp_layout not in ("zigzag", "contiguous"):
        raise ValueError(f"Unsupported context parallel layout cp_layout={cp_layout!r}; pass 'zigzag' or 'contiguous'")
    if not (isinstance(input_ids, Tensor) and input_ids.is_nested):
        raise TypeError("input_ids must be a jagged nested tensor [b, j] (torch.nested.nested_tensor(..., "
                        "layout=torch.jagged)); for padded [b, s] batches use packfwd.verl.model_forward_gen")
    facts = model_facts(model)
    mtp = bool(mtp_enable_train) and facts.post_process
    targets = _mtp_targets(model, input_ids, logits_processor_args or {}) if mtp else None
    extra = multimodal_kwargs(multi_modal_inputs, input_ids.device)
    if data_format == "thd":
        par = read_parallel(local_cp_size)
        if cp_layout == "contiguous" and par.cp > 1:
            raise NotImplementedError("cp_layout='contiguous' with context parallelism is not built in packfwd; "
                                      "use cp_layout='zigzag'")
        if router_padding_mask is not None:
            extra["padding_mask"] = router_padding_mask
        call, pack, unpack = _thd(input_ids, par, facts, vision_model, pad_token_id, pad_to_length_bucket,
                                  local_cp_size, mtp_loss_normalization_factor, mtp)
    else:
        if local_cp_size is not None:
            raise ValueError("local_cp_size (dynamic CP) needs data_format='thd' (as in verl)")
        par = read_parallel()
        call, pack, unpack = _bshd(input_ids, par, facts, vision_model, pad_token_id, forced_max_seqlen, mtp)
    finish = None
    if mtp:  # verl reads the normalization factor from the THD PackedSeqParams only
        factor = mtp_loss_normalization_factor if data_format == "thd" else None
        mtp_kwargs, finish = mtp_call(model, targets, pack, factor)
        call.update(mtp_kwargs)
    result = run_and_unpack(model, {**call, **extra}, facts, unpack, logits_processor, lambda: {
        k: _pack_arg(k, v, pack) for k, v in (logits_processor_args or {}).items() if k not in _NOT_PASSED}, finish)
    if not facts.post_process:
        return result  # a middle pipeline stage: hidden states for the next one
    if value_model and isinstance(result, Tensor):
        result = result.squeeze(-1)
    return result


def _pack_arg(name: str, value, pack):
    if not isinstance(value, Tensor) or value.dim() == 0:
        return value
    if not value.is_nested:
        raise ValueError(f"logits_processor_args[{name!r}] has shape {tuple(value.shape)}; give per-token values as a "
                         "jagged nested tensor like input_ids")
    return pack(next_in_sequence(value) if name == "label" else value)


def next_in_sequence(label: Tensor) -> Tensor:
    """``[b, j]`` jagged: each token's next token in its own sequence, 0 at each sequence's last token.

    >>> import torch
    >>> ids = torch.nested.nested_tensor([torch.tensor([1, 2, 3]), torch.tensor([4, 5])], layout=torch.jagged)
    >>> next_in_sequence(ids).values().tolist()
    [2, 3, 0, 5, 0]
    """
    values, offsets = label.values(), label.offsets()
    token = torch.arange(1, values.shape[0] + 1, device=values.device)
    is_last = torch.isin(token, offsets[1:].to(values.device))
    shifted = torch.roll(values, -1, 0)
    nxt = torch.where(is_last.view(-1, *[1] * (values.dim() - 1)), torch.zeros_like(shifted), shifted)
    return torch.nested.nested_tensor_from_jagged(nxt, offsets)


def _mtp_targets(model, input_ids, args):
    """verl's engine MTP inputs: ``label`` (the tokens themselves, jagged or padded ``[b, s]`` cut to each
    length) and the loss mask built from ``loss_mask``/``response_attention_mask``; each depth's read within its
    own sequence (``packfwd.verl.mtp``)."""
    depth = check_mtp_model(model)
    if "label" not in args or "loss_mask" not in args:
        raise ValueError("MTP training (mtp_enable_train) reads logits_processor_args['label'] and ['loss_mask'], "
                         "as verl does; pass both")
    label = args["label"]
    if not label.is_nested:
        lengths = input_ids.offsets().diff()
        if label.shape[1] < int(lengths.max()):
            raise ValueError(f"label has {label.shape[1]} columns but a sequence has {int(lengths.max())} tokens; "
                             "pass the labels jagged like input_ids or padded to the longest sequence")
        keep = torch.arange(label.shape[1], device=label.device) < lengths.to(label.device)[:, None]
        label = torch.nested.nested_tensor_from_jagged(label[keep], input_ids.offsets())
    mask = engine_loss_mask(input_ids, args["loss_mask"], args.get("response_attention_mask"))
    return mtp_targets(input_ids, None, label, mask, depth, offset=1)


def _thd(input_ids, par: Parallel, facts, vision, pad_token_id, bucket, local_cp_size, mtp_norm, mtp=False):
    info = plan_verl_thd(None, par, fp8_padding=facts.fp8_padding, bucket=bucket, x=input_ids)
    params = verl_packed_seq_params(info, par, local_cp_size)
    if mtp_norm is not None:
        params._verl_mtp_loss_normalization_factor = mtp_norm  # where verl puts it (read by its MTP patches)
    call = dict(input_ids=to_thd(input_ids, info)[0][None] if facts.pre_process or mtp else input_ids,
                attention_mask=None, position_ids=None, packed_seq_params=params)
    if vision:  # verl's vision input: the ids padded to the longest sequence rounded up to align, and the mask
        width = -(-info.seq_len // par.align) * par.align
        mask = torch.arange(width, device=input_ids.device) < input_ids.offsets().diff()[:, None]
        ids = input_ids.to_padded_tensor(0, output_size=(input_ids.shape[0], width))
        call["input_ids"], call["attention_mask"] = _pad_with(ids, mask, pad_token_id), mask

    def pack(v: Tensor) -> Tensor:  # [b, j, *] jagged -> [1, t_local, *]
        return to_thd(v, info)[0][None]

    def unpack(y: Tensor) -> Tensor:  # [1, t_local, *] -> [b, j, *] jagged
        return from_thd(gather_cp(y[0], par), info)

    return call, pack, unpack


def _bshd(input_ids, par: Parallel, facts, vision, pad_token_id, forced_max_seqlen, mtp=False):
    info = plan_bshd(None, x=input_ids, tp_size=par.align)  # width: the longest sequence rounded up to align
    width = _bshd_width(info.width, forced_max_seqlen, par, facts.fp8_padding, input_ids.shape[0])
    ids = to_bshd(input_ids, info)[0]
    mask = _zigzag(_widen(info.attention_mask, width), par)  # [b, w_local] bool
    positions = _zigzag(torch.arange(width, device=mask.device), par, dim=0).expand_as(mask)
    call = dict(input_ids=_zigzag(_widen(ids, width), par) if facts.pre_process or mtp else input_ids,
                attention_mask=mask, position_ids=positions)
    if vision:  # verl's vision input: the whole rows, padded to the forced or longest length rounded up to align
        vision_width = _bshd_width(info.width, forced_max_seqlen, par, False, input_ids.shape[0])
        vision_mask = _widen(info.attention_mask, vision_width)
        call.update(input_ids=_pad_with(_widen(ids, vision_width), vision_mask, pad_token_id),
                    attention_mask=vision_mask, position_ids=None)

    def pack(v: Tensor) -> Tensor:  # [b, j, *] jagged -> [b, w_local, *]
        return _zigzag(_widen(to_bshd(v, info)[0], width), par)

    def unpack(y: Tensor) -> Tensor:  # [b, w_local, *] -> [b, j, *] jagged
        full = _unzigzag(gather_cp(y, par))
        return from_bshd(full[:, : info.width], info)

    return call, pack, unpack


def _bshd_width(longest_aligned: int, forced: int | None, par: Parallel, fp8_padding: bool, batch: int) -> int:
    """verl's BSHD width: ``forced_max_seqlen`` (or the longest) rounded up to the alignment, then for FP8 so
    that ``batch * width`` divides by ``128 * tp * cp``."""
    width = longest_aligned
    if forced is not None:
        if forced < 1:
            raise ValueError(f"forced_max_seqlen must be a positive int, got {forced!r}")
        width = max(width, -(-forced // par.align) * par.align)
    if fp8_padding:
        total = 128 * par.tp * par.cp
        unit = math.lcm(total // math.gcd(batch, total), par.align)
        width = -(-width // unit) * unit
    return width


def _widen(x: Tensor, width: int) -> Tensor:
    """``[b, w0, *] -> [b, width, *]``, zeros (False) on the right."""
    extra = width - x.shape[1]
    if extra == 0:
        return x
    return torch.cat([x, x.new_zeros(x.shape[0], extra, *x.shape[2:])], dim=1)


def _zigzag(x: Tensor, par: Parallel, dim: int = 1) -> Tensor:
    """This CP rank's chunks ``r`` and ``2cp-1-r`` of ``2cp`` equal chunks along ``dim``."""
    if par.cp == 1:
        return x
    chunks = x.chunk(2 * par.cp, dim=dim)
    return torch.cat([chunks[par.cp_rank], chunks[2 * par.cp - 1 - par.cp_rank]], dim=dim)


def _unzigzag(parts: list[Tensor]) -> Tensor:
    """Every CP rank's ``[b, w_local, *]`` (rank order) -> ``[b, w, *]`` in natural order."""
    if len(parts) == 1:
        return parts[0]
    c = parts[0].shape[1] // 2
    return torch.cat([p[:, :c] for p in parts] + [p[:, c:] for p in reversed(parts)], dim=1)


def _pad_with(ids: Tensor, mask: Tensor, pad_token_id: int | None) -> Tensor:
    return ids if pad_token_id is None else ids.masked_fill(~mask, pad_token_id)
