"""A BSHD batch with a padding mask, computed packed: what ``PackedGPTModel.forward(ids, positions, mask)`` runs.

Megatron-Core's ``GPTModel.forward`` takes an ``attention_mask``; packfwd's core attention takes none (it is causal
per packed sequence).  :func:`forward_masked_rows` bridges the two with the layout functions everything else
uses: the rows' real tokens go to the THD layout (``packfwd.layout.plan_thd`` / ``to_thd``), the model runs on
them with its ``PackedSeqParams``, and the outputs come back with ``from_thd`` (zeros at padding).  The checks
are the ones the rest of packfwd uses: the plan validates the mask and ids, the model validates the positions,
and a batch without a real token gets :func:`packfwd.models.runtime.facts.empty_output`.  This is not a third forward:
``make_forward`` is the padded batch's forward with processors, CP and pipelines; this is the model's own
answer to Megatron-Core's calling convention (verl's BSHD forwards call it).
"""

from __future__ import annotations

from packfwd.layout import from_thd, pack_positions, plan_thd, position_ids, to_thd

from .facts import empty_output, model_facts
from ..mlp.moe import router_kwargs

__all__ = ["forward_masked_rows"]


def forward_masked_rows(model, input_ids, positions, attention_mask, mtp_input_ids=None, **kwargs):
    """``model`` on a BSHD batch with a ``[b, s]`` padding mask (True at real tokens), computed packed, with causal
    attention per row.  ``positions``: the caller's ``[b, s]`` / ``[3, b, s]``, else each token's index in its
    row's real tokens.  One host sync (planning).  A pipeline stage without the output layer returns THD hidden
    states ``[t, 1, h]``; the next stage takes them through ``set_input_tensor`` and the same call.

    An MoE model's routers get the plan's ``padding_mask()`` (as ``make_forward`` gives it): the slots the packing
    adds (sequence-parallel padding) reach no expert.  A caller's ``padding_mask [b, s]`` (Megatron-Core's: True
    at a token to keep from the routers) is packed with the same plan and added to it.

    >>> import torch
    >>> from packfwd.models import ModelArgs, build_model
    >>> model = build_model(ModelArgs(vocab_size=64, hidden_size=32, ffn_hidden_size=64, num_layers=1,
    ...                               num_attention_heads=2))
    >>> ids = torch.tensor([[0, 5, 6, 7], [8, 9, 0, 0]]); mask = ids != 0
    >>> out = model(ids, None, mask)          # this function, through PackedGPTModel.forward
    >>> out.shape, bool(out[~mask].any())
    (torch.Size([2, 4, 64]), False)
    >>> bool(torch.allclose(out[0, 1:], model(ids[:1, 1:], None, None)[0], atol=1e-6))  # the row alone
    True
    """
    config = model.config
    if getattr(config, "context_parallel_size", 1) > 1:
        raise ValueError(
            "a BSHD padding mask under context parallelism: the rows would be packed for one rank only; pack the "
            "batch per CP rank with packfwd.to_thd (or make_forward('thd', cp_size=, cp_rank=, cp_group=))"
        )
    if kwargs.get("decoder_input") is not None:
        raise ValueError("decoder_input with a BSHD attention_mask: pack the embeddings with the plan "
                         "(packfwd.to_thd, or make_forward(vision=True)'s packing) and pass packed_seq_params")
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    reads_ids = input_ids is not None and model.pre_process
    info = plan_thd(attention_mask, tp_size=tp, x=input_ids if reads_ids else None)
    if info.source.total == 0:  # no real token: Megatron-Core's attention cannot run an empty batch
        shape = tuple(attention_mask.shape) if model.post_process else (0, 1)
        out = empty_output(model, model_facts(model, tp, 1), shape)
        return out if mtp_input_ids is None else (out, out.expand(len(mtp_input_ids), *out.shape))
    ids = to_thd(input_ids, info)[0][None] if reads_ids else None  # a later stage does not read them
    packed = position_ids(info)[None] if positions is None else pack_positions(positions, info)[..., None, :]
    kwargs.update(_router_padding(model, info, kwargs.pop("padding_mask", None)))
    if mtp_input_ids is not None:  # [D, b, s] -> [D, 1, t]
        kwargs["mtp_input_ids"] = to_thd(mtp_input_ids.permute(1, 2, 0), info)[0].T[:, None]
    out = model(ids, packed, None, packed_seq_params=info.packed_seq_params(), **kwargs)  # [1, t, *]
    if not model.post_process:
        return out
    if mtp_input_ids is None:
        return from_thd(out[0], info)
    logits, depths = out  # [1, t, v], [D, 1, t, v]
    return from_thd(logits[0], info), from_thd(depths[:, 0].transpose(0, 1), info).permute(2, 0, 1, 3)


def _router_padding(model, info, padding_mask) -> dict:
    """``{"padding_mask": [1, t]}``: the plan's pads (an MoE model) and the caller's ``[b, s]`` mask packed."""
    if padding_mask is not None and tuple(padding_mask.shape) != (info.batch_size, info.seq_len):
        raise ValueError(f"padding_mask has shape {tuple(padding_mask.shape)} but attention_mask has shape "
                         f"{(info.batch_size, info.seq_len)}; pass a bool [b, s] mask like attention_mask, True at "
                         "the tokens to keep from the routers")
    given = {} if padding_mask is None else {"padding_mask": to_thd(padding_mask, info)[0][None]}
    planned = router_kwargs(model, info)
    if given and planned:
        return {"padding_mask": given["padding_mask"] | planned["padding_mask"]}
    return given or planned
