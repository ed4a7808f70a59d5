"""The core attention of packfwd's models: Megatron-Core's ``core_attention`` submodule over packed batches.

:class:`CoreAttention` stands where Megatron-Core's layer spec puts ``DotProductAttention`` (or Transformer
Engine's): ``SelfAttention`` builds it with Megatron's keywords plus the spec's params (the varlen backend and
the RoPE of THD batches, :mod:`packfwd.models.runtime.spec`), and calls it with the projected query, key and value.  It
computes attention with :func:`packfwd.models.mixers.varlen.varlen_attention`, and under context parallelism with
:func:`packfwd.parallel.context_parallel_attention`.  A plain ``torch.nn.Module`` whose one parameter, with
sinks (GPT-OSS), is Megatron-Core's ``softmax_offset``: this file never imports Megatron-Core.
"""

from __future__ import annotations

import functools

import torch

from .varlen import CHOICES, PREFER_CUDNN, available_backends, choose_backend, varlen_attention

__all__ = ["CoreAttention", "attention_backends", "thd_cp_place"]


class CoreAttention(torch.nn.Module):
    """Megatron-Core's ``core_attention`` submodule, computed by :func:`~packfwd.models.mixers.varlen.varlen_attention`.

    Built by ``SelfAttention`` with Megatron's builder keywords; ``backend`` and ``rope`` come from the layer
    spec's params (:func:`packfwd.models.runtime.spec.layer_spec`).
    Called as Megatron calls it: ``(query, key, value, attention_mask, *, attn_mask_type, attention_bias,
    packed_seq_params)``, with

    * THD (``packed_seq_params.qkv_format == "thd"``): ``[t, h, d]`` (or ``[t, 1, h, d]``) -> ``[t, h*d]``.
      Sequences are cut at ``cu_seqlens_q_padded`` (pads sit at each sequence's tail, so real tokens never see
      them). Under context parallelism (the CP place ``packed_seq_params.cp`` the plan carries, which the model
      checked against its group; params without one: the group's size and rank), over the group
      ``packed_seq_params.cp_group``, else the one Megatron passes in ``pg_collection.cp``,
      ``packfwd.parallel.context.context_parallel_attention`` computes it over the zigzag split.
    * BSHD (``packed_seq_params is None``): ``[s, b, h, d]`` -> ``[s, b, h*d]``, each row one sequence of length
      ``s`` (real tokens first, as ``packfwd.to_bshd`` lays them out).

    ``attention_mask`` must be None: the causal mask is implied, and padding is removed by packing.

    Megatron-Core's config fields of GPT-OSS attention are read as its ``DotProductAttention`` reads them: a
    sliding window (``config.window_size = (w, 0)`` on the layers ``config.window_attn_skip_freq`` marks: a query
    sees its own sequence's keys at most ``w`` positions back, counted inside that sequence in THD, BSHD and under
    context parallelism) and sinks (``config.softmax_type``: ``"learnable"``, the parameter ``softmax_offset
    [heads / tp]`` of one logit per head added to every softmax denominator; ``"off-by-one"``, zeros).  Both are
    computed by a varlen backend that honours them (:mod:`packfwd.models.mixers.varlen`).

    >>> from types import SimpleNamespace
    >>> config = SimpleNamespace(attention_dropout=0.0, window_size=None, kv_channels=8)
    >>> attn = CoreAttention(config, layer_number=1, attn_mask_type=SimpleNamespace(name="causal"))
    >>> q = torch.randn(5, 2, 3, 8)  # [s, b, h, d]
    >>> attn(q, q, q, None).shape
    torch.Size([5, 2, 24])
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        backend: str | None = None,
        rope=None,
    ):
        super().__init__()
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout:
            raise ValueError(f"attention_dropout={dropout}: packfwd's core attention has no dropout; set it to 0.0")
        self.window = _layer_window(config, layer_number)
        if backend is not None and backend not in CHOICES:
            raise ValueError(f"backend={backend!r} is not one of {CHOICES}; pass one of them or None")
        self.layer_number = layer_number
        self.attn_mask_type = attn_mask_type
        self.backend = backend
        available_backends("cuda")  # look the CUDA kernels up now, eagerly: a compiled forward reads what they found
        self.softmax_scale = softmax_scale if softmax_scale is not None else config.kv_channels**-0.5
        self.cp_group = getattr(pg_collection, "cp", None)
        # RoPE of THD batches (packfwd.models.mixers.rope.PackedRope, from the layer spec): applied here, with no host
        # sync, instead of Megatron-Core's per-sequence THD RoPE.  None: q and k arrive rotated.
        self.rope = rope
        offset = _sinks(config)  # a Parameter [heads / tp] (learnable), zeros (off-by-one: a buffer), or None
        if offset is None or isinstance(offset, torch.nn.Parameter):
            self.softmax_offset = offset
        else:
            self.register_buffer("softmax_offset", offset, persistent=False)

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_mask is not None:
            raise ValueError(
                "packfwd's core attention takes attention_mask=None: it is causal over each packed sequence (THD) or "
                "each row (BSHD, real tokens first); pack the batch with packfwd.to_thd or packfwd.to_bshd instead"
            )
        if attention_bias is not None:
            raise ValueError("packfwd's core attention does not take an attention_bias; pass None")
        causal = _is_causal(self.attn_mask_type if attn_mask_type is None else attn_mask_type)
        if packed_seq_params is not None and packed_seq_params.qkv_format == "thd":
            return self._thd(query, key, value, causal, packed_seq_params)
        if packed_seq_params is not None:
            raise ValueError(f"qkv_format={packed_seq_params.qkv_format!r} is not supported; use 'thd' or no params")
        return self._bshd(query, key, value, causal)

    def _thd(self, q, k, v, causal, params):
        if q.dim() == 4:  # [t, 1, h, d]
            q, k, v = q.squeeze(1), k.squeeze(1), v.squeeze(1)
        cu_q = params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q
        cu_k = params.cu_seqlens_kv_padded if params.cu_seqlens_kv_padded is not None else params.cu_seqlens_kv
        cp_size, cp_rank, group = self.cp_place(params)
        if self.rope is not None:
            q, k = self.rope(q, k, cu_q, cp_size, cp_rank, positions=getattr(params, "position_ids", None))
        attn = functools.partial(varlen_attention, backend=self.backend_for(getattr(params, "bucket", None) is not None),
                                 window=self.window,
                                 sinks=self.softmax_offset)
        if cp_size > 1:
            if not causal:
                raise ValueError("context-parallel attention is causal only; use attn_mask_type=causal")
            from packfwd.parallel.context import context_parallel_attention

            out = context_parallel_attention(
                q, k, v, cu_q, params.max_seqlen_q, cp_size=cp_size, cp_rank=cp_rank, cp_group=group,
                attn_fn=attn, softmax_scale=self.softmax_scale,
            )
        else:
            out = attn(q, k, v, cu_q, cu_k, params.max_seqlen_q, params.max_seqlen_kv, causal, self.softmax_scale)
        return out.reshape(out.shape[0], -1)

    def backend_for(self, bucketed: bool) -> str | None:
        """The backend asked of :func:`varlen_attention` for a THD batch: the named one, or (``backend=None``, the
        automatic choice) ``"prefer_cudnn"`` for a bucket plan's batch (``bucketed``: ``params.bucket`` is set, shapes
        that recur batch after batch, so cuDNN's graph per shape is built once; cuDNN where it has passed its check,
        else the automatic choice), None for the others (cuDNN would build a graph for nearly every batch)."""
        if self.backend is None and bucketed:
            return PREFER_CUDNN
        return self.backend

    def cp_place(self, params) -> tuple[int, int, object]:
        """:func:`thd_cp_place` of a THD batch, with the CP group Megatron passed."""
        return thd_cp_place(params, self.cp_group)

    def _bshd(self, q, k, v, causal):
        if _group_size(self.cp_group) > 1:
            raise ValueError("context parallelism needs the THD layout; use data_format='thd'")
        s, b = q.shape[:2]
        rows = torch.arange(b + 1, device=q.device, dtype=torch.int32) * s

        def flat(x):  # [s, b, h, d] -> [b*s, h, d]
            return x.transpose(0, 1).reshape(b * s, *x.shape[2:])

        out = varlen_attention(flat(q), flat(k), flat(v), rows, rows, s, s, causal, self.softmax_scale,
                               backend=self.backend, window=self.window, sinks=self.softmax_offset)
        return out.reshape(b, s, -1).transpose(0, 1)



def thd_cp_place(params, cp_group) -> tuple[int, int, object]:
    """``(cp_size, cp_rank, group)`` of a THD batch's ``params`` in a token mixer built with ``cp_group`` (the one
    Megatron passed in ``pg_collection.cp``, or None): the CP place the params carry (``params.cp``, checked by the
    model against its group), else the group's (``params.cp_group``, else ``cp_group``; ``params=None``, a BSHD
    batch: ``cp_group``'s).

    >>> from types import SimpleNamespace
    >>> thd_cp_place(SimpleNamespace(cp=None, cp_group=None), None)
    (1, 0, None)
    """
    group = params.cp_group if getattr(params, "cp_group", None) is not None else cp_group
    place = getattr(params, "cp", None)  # the plan's CP place (packfwd.layout.params), checked by the model
    cp_size = place.size if place is not None else _group_size(group)
    cp_rank = place.rank if place is not None else group.rank() if cp_size > 1 else 0
    return cp_size, cp_rank, group


def attention_backends(model: torch.nn.Module, *, bucket_plans: bool = False) -> dict[str, int]:
    """What the attention layers of ``model`` run on its parameters' device and dtype: ``{backend: layers}``, each
    :class:`CoreAttention`'s named backend, or ``backend=None`` resolved as
    :func:`~packfwd.models.mixers.varlen.choose_backend` resolves it (with ``backend='prefer_cudnn'``: cuDNN on CUDA
    once checked; a backend that honours a layer's window or sinks); ``bucket_plans=True``: for a bucket plan's
    batch (:meth:`CoreAttention.backend_for`).  ``forward.attention_backend(model)`` says both in words.

    >>> import torch
    >>> from packfwd.models import ModelArgs, build_model
    >>> attention_backends(build_model(ModelArgs(vocab_size=16, hidden_size=8, ffn_hidden_size=16, num_layers=2,
    ...                                          num_attention_heads=2), params_dtype=torch.bfloat16))
    {'reference': 2}
    """
    param = next((p for p in model.parameters() if p.is_floating_point()), None)
    config = getattr(model, "config", None)
    if param is None or config is None:
        return {}
    d = d_v = getattr(config, "kv_channels", None) or config.hidden_size // config.num_attention_heads
    if getattr(config, "multi_latent_attention", False):
        d, d_v = config.qk_head_dim + config.qk_pos_emb_head_dim, config.v_head_dim
    out: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, CoreAttention):
            features = (("window",) if m.window is not None else ()) + (
                ("sinks",) if m.softmax_offset is not None else ())
            name = choose_backend(param.device, param.dtype, d, d_v, backend=m.backend_for(bucket_plans),
                                  features=features)
            out[name] = out.get(name, 0) + 1
    return out

def _layer_window(config, layer_number: int) -> int | None:
    """The sliding window ``w`` of layer ``layer_number`` (1-based) as Megatron-Core's config gives it
    (``window_size = (w, 0)`` on the layers ``window_attn_skip_freq`` marks: an int N, every layer but each N-th;
    a list, 1 for a windowed layer), or None (full causal attention)."""
    size = getattr(config, "window_size", None)
    if not size:
        return None
    skip = getattr(config, "window_attn_skip_freq", None)
    if isinstance(skip, int) and not isinstance(skip, bool):
        windowed = layer_number % skip != 0
    elif skip is None or isinstance(skip, (list, tuple)):
        windowed = skip is None or bool(skip[layer_number - 1])
    else:
        raise ValueError(f"config.window_attn_skip_freq={skip!r}: pass None, an int or a list of 0/1 per layer")
    left, right = size
    if right != 0 or isinstance(left, bool) or not isinstance(left, int) or left < -1:
        raise ValueError(f"config.window_size={tuple(size)}: packfwd's core attention is causal, its window (w, 0) "
                         "with w >= 0 (or -1: none); pass one of them or window_size=None")
    return left if windowed and left >= 0 else None


def _sinks(config):
    """The core attention's sink logits of ``config.softmax_type`` (Megatron-Core's ``DotProductAttention``'s
    ``softmax_offset``): a parameter of one logit per local head (learnable; initialised by ``config.init_method``
    when ``config.perform_initialization``), zeros (off-by-one), or None (vanilla)."""
    kind = getattr(config, "softmax_type", "vanilla")
    if kind == "vanilla":
        return None
    heads = config.num_attention_heads // config.tensor_model_parallel_size
    if kind == "off-by-one":
        return torch.zeros(heads, dtype=config.params_dtype)
    if kind != "learnable":
        raise ValueError(f"config.softmax_type={kind!r}: pass 'vanilla', 'off-by-one' or 'learnable'")
    offset = torch.nn.Parameter(torch.empty(heads, dtype=config.params_dtype))
    if config.perform_initialization:
        config.init_method(offset.data)
    # split over tensor parallelism by heads, as Megatron-Core's sharded state dict says (grad-norm clipping reads it)
    offset.tensor_model_parallel, offset.partition_dim, offset.partition_stride = True, 0, 1
    return offset


def _is_causal(mask_type) -> bool:
    name = getattr(mask_type, "name", str(mask_type))
    if name == "causal":
        return True
    if name == "no_mask":
        return False
    raise ValueError(f"attn_mask_type={name}: packfwd's core attention supports 'causal' and 'no_mask' only")


def _group_size(group) -> int:
    if group is None or not torch.distributed.is_available() or not torch.distributed.is_initialized():
        return 1
    return group.size()
