"""The forward factory: a padded (or jagged) batch in, the padded model's outputs out, computed packed.

``make_forward(data_format)`` returns a pure function ``forward(model, input_ids, attention_mask, ...)``: argument
translation around packfwd's one forward engine (:class:`packfwd.engine.Engine`: plan, pack every per-token input,
call, heads and extensions, unpack), built once from the options; MTP (:mod:`packfwd.forward.mtp`) and the MoE aux
loss (:mod:`packfwd.forward.moe`) are extensions of it, the vision hook (:mod:`packfwd.forward.vision`) its call
strategy, the fused head (:mod:`packfwd.forward.head`) its head, and they combine.

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

Vision models (``vision=True``) embed first and pack afterwards: the model gets what verl's vision branch gives
it (the padded ids and mask, ``PackedSeqParams``; BSHD: the compacted ones), the entries of ``multi_modal_inputs``
(``pixel_values``, ``image_grid_thw``, ...) as keyword arguments, and a ``packing`` hook that packs its merged
``[b, s, h]`` embeddings and ``[3, b, s]`` positions with the batch's plan (:mod:`packfwd.forward.vision`); a
model without a ``packing`` parameter is refused.

The returned forward carries its layout as ``forward.layout`` (a :class:`ForwardLayout`): what a micro-batch
planner must assume (``plan_micro_batches(..., **forward.layout.plan_args)``) and what ``run_micro_batches``
checks a plan against.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from torch import Tensor

from .._validate import check_bool, check_positive_int, check_rank, cp_rank_for
from ..engine import Batch, Bshd, Engine, Thd, text_call
from ..layout import rules
from .args import check_call_args
from .deterministic import check_layout as check_guarantees
from .deterministic import guarded, invariant_seq_align
from .head import fused_head
from .moe import MoeAuxLoss, RoutingReplay
from .mtp import Mtp
from .scored import Scoring, check_scoring
from .vision import vision_call

__all__ = ["ForwardLayout", "make_forward"]

_FORMATS = ("thd", "bshd")


@dataclass(frozen=True)
class ForwardLayout:
    """The layout a ``make_forward`` forward packs every batch into (``forward.layout``).

    ``seq_align``: THD's per-sequence alignment, resolved (``None`` given: ``rules.default_seq_align(cp_size)``);
    None for BSHD, which pads every row to one width instead.

    >>> spec = make_forward("thd", seq_align=16).layout
    >>> spec
    ForwardLayout(data_format='thd', tp_size=1, cp_size=1, cp_rank=0, seq_align=16)
    >>> spec.plan_args, spec.footprint([3, 20])            # 16 + 32 tokens
    ({'tp_size': 1, 'cp_size': 1, 'seq_align': 16}, 48)
    >>> make_forward("bshd", tp_size=2).layout.footprint([3, 20])   # 2 rows x 20 columns
    40
    """

    data_format: str
    tp_size: int
    cp_size: int
    cp_rank: int
    seq_align: int | None

    @property
    def plan_args(self) -> dict:
        """``plan_micro_batches``' layout arguments for this forward: its THD footprint is then the planner's."""
        return dict(tp_size=self.tp_size, cp_size=self.cp_size, seq_align=self.seq_align)

    def footprint(self, seqlens: Sequence[int]) -> int:
        """Padded tokens per CP rank that the forward makes of a batch of these real lengths (host ints): THD's
        aligned lengths and last-sequence extension over ``cp_size``; BSHD's rows x the longest row rounded up to
        ``tp_size``."""
        lengths = [int(n) for n in seqlens]
        if self.data_format == "bshd":
            return len(lengths) * rules.round_up(max(lengths, default=0), self.tp_size)
        padded = sum(rules.round_up(n, self.seq_align) for n in lengths)
        return rules.footprint(padded, seq_align=self.seq_align, tp_size=self.tp_size, cp_size=self.cp_size)


# a vision model takes the padded batch and its attention_mask (its positions come from them): plan= has neither
_NO_VISION_PLAN = ("plan= is not built for make_forward(vision=True): the vision model reads the padded batch's "
                   "attention_mask; pass attention_mask (and seqlens) to the forward instead")


def make_forward(
    data_format: str = "thd",
    *,
    vision: bool = False,
    logits_processor: Callable[..., Mapping[str, Tensor]] | None = None,
    tp_size: int = 1,
    cp_size: int = 1,
    cp_rank: int | None = None,
    cp_group=None,
    seq_align: int | None = None,
    check_group=None,
    mtp: bool = False,
    head: str = "logits",
    moe_aux_loss: bool = False,
    record_routing: bool = False,
    deterministic: bool = False,
    batch_invariant: bool = False,
    scored_only: bool = True,
) -> Callable:
    """A pure ``forward(model, input_ids, attention_mask, position_ids=None, multi_modal_inputs=None, *,
    seqlens=None, **processor_args)`` (see the module docstring).

    ``seqlens``: the real length of every row as host ints (a list, or a CPU tensor), when the caller knows them
    (an RL trainer does): the plan is then made with no host sync, and the whole forward makes none.  Without
    it the plan reads the lengths back from the device once.

    ``tp_size``: the tensor-parallel size when the model uses sequence parallelism (packed lengths must divide by
    it); ``cp_size``/``cp_rank``/``cp_group``: context parallelism (THD only): each rank packs its zigzag share
    (``cp_rank``, this process's rank in ``cp_group``, is required when ``cp_size > 1``),
    and the outputs of all CP ranks are all-gathered over ``cp_group`` to unpack them (the gather's backward keeps
    this rank's share of the gradient: every rank must compute the same loss from the unpacked outputs).
    ``seq_align``: per-sequence alignment of ``plan_thd``.

    ``plan``: the batch's plan made ahead by ``forward.plan(input_ids, attention_mask, seqlens=None, bucket=None)``
    (THD): ``forward(model, input_ids, plan=plan, ...)`` then packs with it and plans nothing (no host work, no
    upload: what a CUDA graph needs, or a trainer planning the next micro-batch while this one runs).  ``bucket``
    (:class:`packfwd.layout.bucket.Bucket`) fixes every shape of the plan: a step captured as a CUDA graph with one
    bucket plan replays for any batch that fits it, after ``packfwd.layout.bucket.copy_plan_(captured, new)``.  A
    plan of another layout (``tp_size``, ``cp_size``, ``cp_rank``, ``seq_align``) or another batch shape raises.

    ``mtp=True``: for a model with multi-token prediction layers (with any other option but ``head="fused"``, whose
    model call returns the final hidden states only); the forward also takes ``mtp_loss_mask [b, s]``
    (the main loss mask, default every token) and adds ``"mtp_log_probs" [b, s, D]`` and ``"mtp_loss" [D]`` to
    its outputs (a dict; without a processor the logits are ``"logits"``): see :mod:`packfwd.forward.mtp`.

    ``head="fused"``: the last stage returns hidden states and the processor's fused form computes its numbers
    from them and the output weight, without ``[t, v]`` logits (``logits_processor=log_probs_and_entropy``; its
    ``token_mask`` argument limits the work to those tokens): see :mod:`packfwd.forward.head`.

    ``moe_aux_loss=True`` (a Mixture-of-Experts model): the outputs are a dict (without a processor the logits are
    ``"logits"``) with ``"moe_aux_loss"``, the load-balancing loss of the batch's real tokens, unscaled, every MoE
    layer pooled as transformers' ``load_balancing_loss_func`` pools them
    (:func:`packfwd.models.mlp.routing.load_balancing_loss`).  On pipeline stages the loss pools the layers of every
    stage: a stage before the last returns ``(hidden, routing)`` (its layers' routing sums, plus those it was
    given: :func:`packfwd.models.mlp.aux_loss.stage_routing_sums`), and every later stage takes the previous one's as
    ``moe_routing=``; ``run_micro_batches(..., pp_group=...)`` hands it on, its gradient back with the hidden
    states'.  With it or not, an MoE model's routers never route a
    layout pad (the plan's ``padding_mask()``, passed as the model's ``padding_mask``).

    ``record_routing=True`` (an MoE model): the outputs are a dict with ``"routed_experts" [b, s, L, k]`` int64,
    each real token's experts at each of the model's ``L`` MoE layers in layer order, ``-1`` at padding.  Any
    forward takes ``routed_experts=`` of that shape (any integer dtype): router replay, each real token of MoE layer
    ``l`` goes to those experts with the weights the current router gives them (values at padding ignored); with
    ``replay_mask`` (bool ``[b, s]`` like the attention mask) only the tokens where it is True are replayed, the
    others routed by the current router as without replay (their rows of ``routed_experts`` ignored).  With
    ``record_routing`` it records the experts used.  On pipeline stages the record covers every stage's MoE
    layers: a stage before the last returns ``(hidden, record)`` (its packed record ``[t', L_so_far, k]``, the
    layers of every stage up to it), every later stage takes the previous one's as ``recorded_routing=``, and the
    last stage's ``"routed_experts"`` is the whole model's record, every stage's layers joined in layer order;
    ``run_micro_batches(..., pp_group=...)`` hands it on.  With ``moe_aux_loss=True`` too a stage returns
    ``(hidden, record, routing sums)``; ``forward.carried`` names, in that order, the keyword each carried entry goes
    to.  See :class:`packfwd.forward.moe.RoutingReplay`.

    **Scored tokens only** (``scored_only=True``, the default): with a logits processor, a token whose label is
    ignored (``labels < 0``, e.g. -100), or outside ``loss_mask`` (a ``[b, s]`` forward argument) or the
    processor's ``token_mask``, skips the vocab projection and the log-softmax on either head; **every output of
    the processor is exactly 0 there** (entropy too) and sends no gradient; at the scored tokens values and
    gradients are the full head's.  ``scored_tokens`` (a host int: the scored tokens of the batch, or more) sizes
    the work with no host sync; without it the forward reads the count once when it plans from the device mask,
    and computes every row (masked) when ``seqlens`` or ``plan`` promise no sync: see
    :mod:`packfwd.forward.scored`.  A value model, a forward without a processor and one given neither labels
    nor a mask are unchanged; ``scored_only=False`` scores every token (``loss_mask`` is then refused).

    ``batch_invariant=True`` (CUDA, THD, ``tp_size=1``): a sequence's outputs are the same bits whatever it is
    packed with; ``deterministic=True``: the parameter gradients of a batch are the same bits run after run.  Each
    checks the torch / cuBLAS state it needs at every call and raises naming the fix
    (``packfwd.forward.deterministic.enable()`` sets it): see :mod:`packfwd.forward.deterministic`.
    ``batch_invariant=True`` also aligns every sequence to a multiple of 16 rows (``seq_align``: None gives the
    smallest valid multiple; another value must be a multiple of 16), so no batch is smaller than a GEMM tile.

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
    tp_size = check_positive_int("tp_size", tp_size)
    cp_size = check_positive_int("cp_size", cp_size)
    if cp_size > 1 and data_format != "thd":
        raise ValueError("context parallelism needs data_format='thd'")
    if seq_align is not None and data_format != "thd":
        raise ValueError(
            f"seq_align={seq_align} only applies to data_format='thd' (BSHD pads every row to one width, a "
            "multiple of tp_size); drop seq_align or use data_format='thd'"
        )
    if cp_size > 1 and cp_group is None:
        raise ValueError("cp_size > 1 needs cp_group (to gather every CP rank's outputs); pass the CP process group")
    # required under CP, as plan_thd requires it: a default of 0 packed rank 0's share on every rank, and the rank
    # whose model then refused it raised alone while the others waited in the attention's all-gather
    cp_rank = check_rank("cp_rank", cp_rank_for(cp_size, cp_rank), cp_size, "cp_size")
    check_guarantees(data_format, tp_size, deterministic=deterministic, batch_invariant=batch_invariant)
    if batch_invariant:  # no packed batch smaller than one GEMM tile's rows (deterministic.INVARIANT_MIN_ROWS)
        seq_align = invariant_seq_align(seq_align, cp_size, tp_size)
    layout = Thd(tp_size, cp_size, cp_rank, cp_group, seq_align) if data_format == "thd" else Bshd(tp_size)
    spec = ForwardLayout(data_format, tp_size, cp_size, cp_rank,
                         rules.check_seq_align(seq_align, cp_size, tp_size) if data_format == "thd" else None)
    for name, flag in (("scored_only", scored_only), ("record_routing", record_routing),
                       ("moe_aux_loss", moe_aux_loss), ("mtp", mtp), ("vision", vision)):
        check_bool(name, flag)
    fused = fused_head(head, logits_processor)
    if fused is not None and mtp:  # the fused head's model call returns the final hidden states alone
        raise ValueError("head='fused' with mtp=True: the fused head asks the model for its final hidden states "
                         "(return_hidden=True), which skips the output layer that every MTP depth's logits come "
                         "from; use head='logits' with mtp=True")
    extensions = (RoutingReplay(record_routing),) + (MoeAuxLoss(),) * moe_aux_loss + (Mtp(),) * mtp
    engine = Engine(layout, processor=logits_processor, head=fused, extensions=extensions,
                    call=vision_call if vision else text_call, tp_size=tp_size, cp_size=cp_size, cp_rank=cp_rank,
                    cp_group=cp_group, check_group=check_group,
                    scoring=Scoring(hidden=not mtp) if scored_only else None)
    bare = logits_processor is None and not (moe_aux_loss or mtp or record_routing)  # the logits alone, not a dict

    def forward(model, input_ids, attention_mask=None, position_ids=None, multi_modal_inputs=None, *,
                seqlens=None, plan=None, moe_routing=None, mtp_loss_mask=None, routed_experts=None, replay_mask=None,
                loss_mask=None, scored_tokens=None, recorded_routing=None, **processor_args):
        mask = attention_mask if attention_mask is not None else getattr(getattr(plan, "source", None), "mask", None)
        check_call_args(processor_args, logits_processor, multi_modal_inputs, vision, mask, loss_mask, scored_only)
        check_scoring(loss_mask, scored_tokens, logits_processor, scored_only, processor_args)
        if plan is not None and vision:
            raise TypeError(_NO_VISION_PLAN)
        if moe_routing is not None and not moe_aux_loss:
            raise TypeError("moe_routing= (the routing sums an earlier pipeline stage hands on) is taken by a "
                            "make_forward(..., moe_aux_loss=True) forward only; build it so, or drop moe_routing")
        if recorded_routing is not None and not record_routing:
            raise TypeError("recorded_routing= (the record an earlier pipeline stage hands on) is taken by a "
                            "make_forward(..., record_routing=True) forward only; build it so, or drop "
                            "recorded_routing")
        if mtp_loss_mask is not None and not mtp:
            raise TypeError("mtp_loss_mask is an argument of the multi-token-prediction forward, which this forward "
                            "is not; build it with make_forward(..., mtp=True) (for a model with MTP layers), or "
                            "drop mtp_loss_mask")
        batch = Batch(input_ids, attention_mask, position_ids, seqlens=seqlens, plan=plan, inputs=processor_args,
                      model_inputs=dict(multi_modal_inputs or {}),
                      options=dict(moe_routing=moe_routing, mtp_loss_mask=mtp_loss_mask, routed_experts=routed_experts,
                                   replay_mask=replay_mask, loss_mask=loss_mask, scored_tokens=scored_tokens,
                                   recorded_routing=recorded_routing))
        result = engine(model, batch)
        if result.outputs is None:  # a stage before the last: hidden states (and what it carries) for the next
            return result.hand_on
        return result.outputs["logits"] if bare else result.outputs

    def plan(input_ids, attention_mask=None, *, seqlens=None, bucket=None):
        """This forward's plan of a batch, made ahead of the call: ``forward(model, input_ids, plan=plan)``
        (THD; ``bucket``: a :class:`packfwd.layout.bucket.Bucket`, shapes fixed for a CUDA graph)."""
        if vision:
            raise TypeError(_NO_VISION_PLAN)
        if bucket is not None:
            return layout.plan_bucket(attention_mask, bucket, seqlens)
        return layout.plan(input_ids, attention_mask, seqlens)

    forward = guarded(forward, deterministic=deterministic, batch_invariant=batch_invariant)
    forward.layout = spec  # what a micro-batch plan must assume (run_micro_batches checks it)
    forward.moe_aux_loss = moe_aux_loss  # its middle stages return (hidden, routing sums): packfwd's schedule only
    # what a middle stage returns beside its hidden states, as the next stage's keywords, in the extensions' order
    forward.carried = ("recorded_routing",) * record_routing + ("moe_routing",) * moe_aux_loss
    forward.engine = engine
    forward.plan = plan
    forward.attention_backend = _attention_backend  # what a model's attention runs (the automatic choice resolved)
    return forward


def _attention_backend(model) -> str:
    """What ``model``'s attention layers run (``forward.attention_backend(model)``): ``backend=None`` resolved on
    the model's device and dtype, as :func:`packfwd.models.mixers.attention.attention_backends` says it; one name, or
    each with its layer count (``"cudnn x 12, reference x 12"``: layers with a window or sinks take a backend that
    honours them); where a bucket plan's batch (CUDA graphs, ``run_micro_batches``' padded micro-batches) runs another,
    that too (``"torch_varlen; cudnn on bucket plans"``).

    >>> import torch
    >>> from packfwd.models import ModelArgs, build_model
    >>> model = build_model(ModelArgs(vocab_size=16, hidden_size=8, ffn_hidden_size=16, num_layers=2,
    ...                               num_attention_heads=2))
    >>> make_forward("thd").attention_backend(model)      # on the CPU: the reference
    'reference'
    """
    from ..models.mixers.attention import attention_backends
    from ..models.runtime.gpt import unwrap

    def words(found: dict) -> str:
        if len(found) <= 1:
            return next(iter(found), "none")
        return ", ".join(f"{name} x {n}" for name, n in found.items())

    plain = words(attention_backends(unwrap(model)))
    bucketed = words(attention_backends(unwrap(model), bucket_plans=True))
    return plain if bucketed == plain else f"{plain}; {bucketed} on bucket plans"
