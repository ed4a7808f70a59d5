"""A BSHD batch with a padding mask, computed packed: what ``PackedGPTModel.forward(ids, positions, mask)`` runs.

Megatron-Core's ``GPTModel.forward`` takes an ``attention_mask``; packfwd's core attention takes none (it is causal
per packed sequence).  :func:`forward_masked_rows` bridges the two with the layout functions everything else
uses: it is packfwd's one forward engine (:class:`packfwd.engine.Engine`) with the THD adapter, no processor, and
:class:`_CallerInputs` packing the caller's router mask and MTP ids with the same plan: the rows' real tokens go to
the THD layout, the model runs on them with its ``PackedSeqParams``, and the outputs come back with zeros at
padding; an MoE model's routers never see a pad, a batch without a real token is not run.  It is the model's
answer to Megatron-Core's calling convention (verl's own forwards call it).
"""

from __future__ import annotations

from packfwd.engine import Batch, Engine, Extension, Thd

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
    engine = Engine(Thd(tp, 1, 0, None, None), extensions=(_CallerInputs(),), tp_size=tp, check_cp=False,
                    squeeze_value=False)  # the model's own output shape, [b, s, 1] for a value head
    ids = input_ids if input_ids is not None and model.pre_process else None  # a later stage reads none
    options = {"padding_mask": kwargs.pop("padding_mask", None), "mtp_input_ids": mtp_input_ids}
    result = engine(model, Batch(ids, attention_mask, positions, model_inputs=kwargs, options=options))
    if result.outputs is None:
        return result.hand_on
    if mtp_input_ids is None:
        return result.outputs["logits"]
    return result.outputs["logits"], result.outputs["mtp_logits"].permute(2, 0, 1, 3)  # [D, b, s, v]


class _CallerInputs(Extension):
    """The caller's ``padding_mask [b, s]`` (True at tokens to keep from the routers) and ``mtp_input_ids [D, b,
    s]``, packed with the batch's plan; the MTP depths' logits unpacked beside the main ones."""

    def inputs(self, step) -> dict:
        opts, plan = step.batch.options, step.plan
        out = {}
        mask = opts.get("padding_mask")
        if mask is not None:
            if tuple(mask.shape) != (plan.batch_size, plan.seq_len):
                raise ValueError(f"padding_mask has shape {tuple(mask.shape)} but attention_mask has shape "
                                 f"{(plan.batch_size, plan.seq_len)}; pass a bool [b, s] mask like attention_mask, "
                                 "True at the tokens to keep from the routers")
            out["padding_mask"] = mask
        if opts.get("mtp_input_ids") is not None:
            out["mtp_ids"] = opts["mtp_input_ids"].permute(1, 2, 0)  # [D, b, s] -> [b, s, D]
        return out

    def model_kwargs(self, step) -> dict:
        kw = {}
        if "padding_mask" in step.packed:
            kw["padding_mask"] = step.packed["padding_mask"][None]  # [1, t]
        if "mtp_ids" in step.packed:
            kw["mtp_input_ids"] = step.packed["mtp_ids"].T[:, None]  # [D, 1, t]
        return kw

    def finish(self, out, step):
        if "mtp_ids" not in step.packed:
            return out, {}
        if step.empty:
            return out, {"mtp_logits": step.unpack(step.tokens(out)[:, None].expand(-1, step.packed["mtp_ids"].shape[1], -1))}
        logits, depths = out  # [1, t, v], [D, 1, t, v]
        return logits, {"mtp_logits": step.unpack(depths[:, 0].transpose(0, 1))}  # [t, D, v] -> [b, s, D, v]
