"""``make_forward(..., head="fused")``: the last stage returns its final hidden states and packfwd computes the
logits processor's numbers from them and the output weight, never forming the ``[t, v]`` logits.

The processor names what is computed: it must have a fused form, the same numbers as a function of ``(hidden
[t, h], weight [v_local, h], **the same arguments)``, kept as its ``fused`` attribute.
``packfwd.logits.log_probs_and_entropy`` has one (:func:`packfwd.logits.fused_log_probs_and_entropy`), so

    make_forward(fmt, logits_processor=log_probs_and_entropy, head="fused")

gives what the same call with ``head="logits"`` gives (the default; to float32 rounding, see the tests), with
``labels``, ``temperature`` (per token or per sequence, differentiable) and ``token_mask`` (compute only those
tokens, e.g. the response; the others are 0) packed like every processor argument.  A tensor temperature is
checked at real tokens, as with the logits head: ``make_forward`` passes ``real_tokens`` (False at the layout's
padding slots, which hold the packing's fill), reordered like the other per-token arguments.

How: the model is called with ``return_hidden=True`` (:class:`packfwd.models.runtime.model.PackedGPTModel` then skips
its output layer and returns the final-normed hidden states ``[s, b, h]``, this rank's token slice under
sequence parallelism).  The weight is the output layer's, or the word embedding when they are tied (as
Megatron-Core's ``GPTModel`` picks it), this rank's vocab rows under tensor parallelism.  Under sequence
parallelism the fused function gathers the hidden states over the TP group itself (its backward
reduce-scatters).  The hidden rows are in ``[s, b]`` order: for BSHD (``b > 1``) the per-token arguments are
put in that order and the results back, so that Megatron's sequence split stays a split of rows.  Pipeline
stages without the output layer are unchanged; an empty batch takes the unfused path on zero logits (gradients
tied to the parameters).

Refused (a ValueError or TypeError at the call, before the model runs): a processor without a fused form, a
value model, a model whose ``forward`` takes no ``return_hidden``, an output layer with a bias, MuP logit scaling.
"""

from __future__ import annotations

import functools
import inspect

from torch import Tensor

__all__ = ["FusedHead", "HEADS", "fused_head", "output_weight"]

HEADS = ("logits", "fused")


def fused_head(head: str, processor):
    """The head ``make_forward`` runs: None for the logits, a :class:`FusedHead` for ``head="fused"``."""
    if head not in HEADS:
        raise ValueError(f"head={head!r}; pass one of {HEADS}")
    if head == "logits":
        return None
    if processor is None:
        raise ValueError(
            "head='fused' computes a logits processor's numbers from the hidden states; pass "
            "logits_processor=packfwd.logits.log_probs_and_entropy (or another processor with a fused form)"
        )
    fn, bound = _unbind(processor)
    if getattr(fn, "fused", None) is None:
        name = getattr(fn, "__name__", type(fn).__name__)
        raise ValueError(
            f"head='fused' needs a logits processor with a fused form (a 'fused' attribute, as "
            f"packfwd.logits.log_probs_and_entropy has); {name!r} reads the logits themselves: use head='logits'"
        )
    if "chunk_size" in bound:
        raise ValueError(
            "the processor binds chunk_size (tokens per block of the logits), which the fused head does not use "
            "(it blocks the vocabulary); leave chunk_size unbound with head='fused'"
        )
    return FusedHead()


class FusedHead:
    """What ``make_forward`` does differently with ``head="fused"`` (see the module docstring)."""

    model_kwargs = {"return_hidden": True}

    def check_model(self, model, facts) -> None:
        """Eager checks (in the forward's validation, before the model runs)."""
        from ..models.runtime.gpt import unwrap  # imports no Megatron-Core

        gpt = unwrap(model)
        if "return_hidden" not in inspect.signature(gpt.forward).parameters:
            raise TypeError(
                f"head='fused' needs a model whose forward takes return_hidden=True (packfwd's PackedGPTModel); "
                f"{type(gpt).__name__}.forward does not: use head='logits'"
            )
        if not facts.post_process:
            return
        head = getattr(gpt, "output_layer", None)
        if getattr(head, "bias", None) is not None:
            raise ValueError("the model's output layer has a bias, which the fused head does not add; use "
                             "head='logits'")
        if getattr(getattr(gpt, "config", None), "use_mup", False):
            raise ValueError("the model scales its logits (MuP), which the fused head does not; use head='logits'")

    def run(self, processor, model, facts, out: Tensor, args: dict) -> tuple[dict, int]:
        """The processor's fused form on the hidden states ``out [s, b, h]``: ``({name: [t, ...]}, t)``, rows in the
        layout's token order (``layout.tokens``)."""
        from ..models.runtime.gpt import unwrap

        gpt = unwrap(model)
        fn, bound = _unbind(processor)
        weight = output_weight(gpt)
        sp = bool(getattr(gpt.config, "sequence_parallel", False)) and facts.tp_size > 1
        b = out.shape[1]
        t = out.shape[0] * b * (facts.tp_size if sp else 1)
        hidden = out.reshape(-1, out.shape[-1]).to(weight.dtype)  # [s * b, h]: rows in [s, b] order
        args = {k: _reorder(v, t, b, to_seq=True) for k, v in args.items()}
        kwargs = {**bound, **args} if not sp else {**bound, **args, "sequence_parallel": True}
        results = fn.fused(hidden, weight, **kwargs)
        if not isinstance(results, dict):
            return results, t  # check_results names the problem
        return {k: _reorder(v, t, b, to_seq=False) for k, v in results.items()}, t


def output_weight(gpt) -> Tensor:
    """The output layer's weight ``[v_local, h]`` as Megatron-Core's ``GPTModel`` uses it: the word embedding's
    when they are tied (on the stage that holds it), else the output layer's own."""
    if getattr(gpt, "share_embeddings_and_output_weights", False):
        return gpt.shared_embedding_or_output_weight()
    return gpt.output_layer.weight


def _unbind(processor):
    """``(function, bound keywords)`` of a processor, through ``functools.partial`` layers."""
    fn, bound = processor, {}
    while isinstance(fn, functools.partial):
        if fn.args:
            raise ValueError("head='fused' takes a processor with keyword arguments bound only (functools.partial)")
        bound = {**fn.keywords, **bound}
        fn = fn.func
    return fn, bound


def _reorder(x, t: int, b: int, *, to_seq: bool):
    """A per-token ``[t, ...]`` tensor in ``[s, b]`` order (``to_seq``) or back
    (:func:`packfwd.engine.seq_major`); anything else unchanged."""
    from ..engine import seq_major

    if not isinstance(x, Tensor) or x.dim() == 0 or x.shape[0] != t:
        return x
    return seq_major(x, b, inverse=not to_seq)

