"""Causal variable-length attention over packed sequences: the backends and the automatic choice among them.

One call computes attention for many sequences laid end to end (``q: [t_q, h, d]``, ``k, v: [t_k, h_kv, d]``)
without padding, described by ``cu_seqlens`` the way flash-attn and Megatron-Core describe it::

    cu_seqlens = [0, 3, 5]      two sequences: tokens 0..2 and tokens 3..4
    causal:  token 4 attends to tokens 3 and 4, never to 0..2

Backends (``backend=`` a name, or None for the best available one for the inputs):

* ``"flash_attn"``: ``flash_attn.flash_attn_varlen_func`` (CUDA, fp16/bf16), when flash-attn is installed.
* ``"torch_varlen"``: ``torch.nn.attention.varlen.varlen_attn`` (CUDA, fp16/bf16), PyTorch's own flash kernel.
* ``"cudnn"``: cuDNN's fused attention over ragged offsets (CUDA, fp16/bf16), through the ``nvidia-cudnn-frontend``
  package's torch op (``cudnn.sdpa_torch``) and the cuDNN torch ships; the optional extra ``packfwd[cudnn]``.
  Named, or taken by ``backend="prefer_cudnn"`` where it is faster (:func:`choose_backend`: fp16/bf16, one head dim
  of at most 128) once it has passed a check on the device (a small attention, forward and backward, against the
  reference), not under split-K control (batch invariance: cuDNN plans per batch shape).  One cuDNN graph per distinct ``(n, max_seqlen)`` (forward) and
  per token total (backward) is built on first use and cached (``max_seqlen`` is rounded up to a multiple of 64
  here so that batches of similar lengths share one); takes ``d_v != d`` without padding.

The flash backward passes accumulate ``dq`` with atomics (not bitwise run to run) unless torch's deterministic mode
(``torch.use_deterministic_algorithms(True)``) is on: torch's kernel reads it when the backward runs, flash-attn's
when the forward runs (packfwd passes it as ``deterministic=True``).
* ``"flex"``: PyTorch's ``flex_attention`` compiled to Triton (CUDA; torch >= 2.9), block-masked per sequence
  (:mod:`packfwd.models.mixers.varlen_flex`): the CUDA backend that honours a sliding window and sinks.
* ``"reference"``: pure PyTorch, any device and dtype, exact (float32 math for half inputs, float64 for float64).

All follow flash-attn's semantics: grouped-query attention when ``h_kv`` divides ``h``; with ``causal`` and
``seqlen_q != seqlen_k`` the causal mask is aligned to the bottom-right corner (query ``i`` of a sequence sees
keys ``j <= i + seqlen_k - seqlen_q``); a query that sees no key outputs zeros.

Sliding windows and sinks (GPT-OSS; keyword arguments of :func:`varlen_attention`): ``window=w`` lets a query see
only the keys at most ``w`` positions before it in its own sequence (flash-attn's ``window_size=(w, 0)``, aligned
bottom-right as the causal mask is: query ``i`` sees keys ``i + seqlen_k - seqlen_q - w <= j <= i + seqlen_k -
seqlen_q``; transformers' ``sliding_window`` W is ``w = W - 1``); ``sinks=[h]`` adds ``exp(sinks[head])`` to every
softmax denominator of that query head (a learned logit with no value: the weights of the real keys sum to less
than 1).  ``flex`` and the reference compute them (``BACKEND_FEATURES``): with either given the automatic choice
is ``flex`` for fp16/bf16 on CUDA (torch >= 2.9), else the reference (on CUDA with a one-time warning: it pads to
``max_seqlen``); a named backend that cannot honour them raises.

Automatic choice (``backend=None``, :func:`choose_backend`): for fp16/bf16 inputs on CUDA the first flash backend
present; else the reference (``"prefer_cudnn"``: cuDNN first, where checked).  packfwd's models ask ``"prefer_cudnn"``
for a batch planned into a fixed bucket (``packfwd.layout.bucket``: CUDA graphs, ``StepGraphs``), whose shapes recur
(:meth:`packfwd.models.mixers.attention.CoreAttention.backend_for`).  float32 and float64 inputs on CUDA have no flash kernel (both take fp16/bf16 only), so they go to the
reference, which pads every sequence to ``max_seqlen`` (work ``n * max_seqlen**2`` per head, against
``sum(len_i**2)`` for a varlen kernel); a warning says so once per dtype (run the model in bfloat16 to get
``torch_varlen`` or ``flash_attn``).

:class:`packfwd.models.mixers.attention.CoreAttention` runs packfwd's models' attention through :func:`varlen_attention`.
This file imports neither Megatron-Core nor the optional kernels until they are used (a ``CoreAttention`` looks
them up when built, so that a compiled forward only reads what they found).  The kernels' signatures and the
head-dim padding they need for multi-head latent attention belong with the backends.
"""

from __future__ import annotations

import functools
import inspect
import math
import warnings

import torch
from torch import Tensor

from packfwd.layout.rules import round_up

__all__ = ["BACKENDS", "BACKEND_FEATURES", "CHOICES", "PREFER_CUDNN", "available_backends", "choose_backend", "cudnn_check", "varlen_attention",
           "varlen_attention_reference"]

BACKENDS = ("flash_attn", "torch_varlen", "cudnn", "flex", "reference")
# cuDNN where it passes cudnn_check on the device, else the automatic choice (choose_backend).  What packfwd's
# attention asks for a bucket plan's batch when no backend is named (CoreAttention.backend_for): its shapes recur, so
# cuDNN's graph per shape is built once; not for other batches, where nearly every one is a new shape.
PREFER_CUDNN = "prefer_cudnn"
CHOICES = BACKENDS + (PREFER_CUDNN,)  # what backend= takes besides None
# What each backend computes beyond plain (causal) attention: a sliding window, per-head sinks (module docstring).
BACKEND_FEATURES = {"flash_attn": (), "torch_varlen": (), "cudnn": (), "flex": ("window", "sinks"),
                    "reference": ("window", "sinks")}
_AUTOMATIC = ("flash_attn", "torch_varlen")  # the CUDA kernels the automatic choice takes, best first
_HALF = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def _flash_attn_func():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:  # not installed (or built for another torch): the backend is simply absent
        return None
    return flash_attn_varlen_func


@functools.lru_cache(maxsize=None)
def _torch_varlen_func():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    return varlen_attn


@functools.lru_cache(maxsize=None)
def _cudnn_func():
    try:
        import cudnn

        return cudnn.sdpa_torch  # importing it registers cuDNN's torch ops (torch.ops.cudnn.sdpa_fwd / _bwd)
    except Exception:  # noqa: BLE001 - not installed, or no cuDNN library it can load: the backend is absent
        return None


@functools.lru_cache(maxsize=None)
def _flex_func():
    from .varlen_flex import flex_available, flex_varlen_attention

    return flex_varlen_attention if flex_available() else None  # torch < 2.9: absent


def available_backends(device: torch.device | str = "cpu") -> tuple[str, ...]:
    """The backends usable for tensors on ``device``, best first (``"reference"`` is always last).

    >>> available_backends("cpu")
    ('reference',)
    """
    if torch.device(device).type != "cuda":
        return ("reference",)
    kernels = _kernels()
    return (*(name for name in ("flash_attn", "torch_varlen", "cudnn", "flex") if kernels[name] is not None),
            "reference")


# The optional kernels by backend name (None: absent) as last looked up eagerly.  A compiled forward reads this
# plain dict: dynamo ignores lru_cache and would trace the imports, and a failing one (flash-attn not installed)
# breaks the graph.  CoreAttention looks them up when built; with nothing recorded a compiled call traces them.
_KERNELS: dict = {}


def _kernels() -> dict:
    if not _KERNELS or not torch.compiler.is_compiling():
        _KERNELS.update(flash_attn=_flash_attn_func(), torch_varlen=_torch_varlen_func(), cudnn=_cudnn_func(),
                        flex=_flex_func())
    return _KERNELS


def _resolve(backend: str | None, device: torch.device, dtype: torch.dtype, features: tuple[str, ...] = (),
             head_dims: tuple[int, int] | None = None) -> str:
    """The backend that runs inputs of ``dtype`` on ``device``: ``backend`` checked, or the automatic choice;
    ``features``: what the call needs beyond plain attention (``"window"``, ``"sinks"``: ``BACKEND_FEATURES``);
    ``head_dims``: ``(d, d_v)`` (None: cuDNN is not considered)."""
    if features:
        return _resolve_features(None if backend == PREFER_CUDNN else backend, device, dtype, features)
    usable = available_backends(device)
    if backend == PREFER_CUDNN:
        if dtype in _HALF and head_dims is not None and _cudnn_is_automatic(device, dtype, *head_dims):
            return "cudnn"
        backend = None
    if backend is None:
        automatic = [name for name in usable if name in _AUTOMATIC]
        if dtype in _HALF and automatic:
            return automatic[0]
        # a CUDA device with a flash kernel, which takes fp16/bf16 only (a compiled call cannot warn unbroken)
        if automatic and not torch.compiler.is_compiling():
            _warn_slow_dtype(dtype, automatic[0])
        return "reference"
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {CHOICES}; pass one of them or None (automatic)")
    if backend == "cudnn" and backend in usable and dtype not in _HALF:
        raise TypeError(f"backend='cudnn' takes float16/bfloat16 inputs, got {dtype}; cast them, or pass "
                        "backend='reference' (any dtype)")
    if backend not in usable:
        raise ValueError(
            f"backend={backend!r} is not usable for tensors on {device} here (usable: {usable}); install it, move "
            "the inputs to CUDA, or pass backend=None"
        )
    return backend


def _resolve_features(backend: str | None, device: torch.device, dtype: torch.dtype, features: tuple[str, ...]) -> str:
    """The backend of a call with a sliding window or sinks: the first usable one that honours them (None), or
    ``backend`` when it does; never one that would drop them."""
    honours = [name for name in available_backends(device) if set(features) <= set(BACKEND_FEATURES[name])]
    if backend is None:
        # flex for fp16/bf16 on CUDA (tests/gpu/test_gpt_oss_cuda.py and check_attention_backends.py passed on an
        # H100); the reference, exact everywhere, for the rest (float32: flex's GPU test ran in bf16 only)
        # (not under batch invariance: flex's blocks span sequences, so a sequence's bits would follow its offset)
        name = "flex" if (device.type == "cuda" and dtype in _HALF and "flex" in honours
                          and not _batch_invariance_asked(dtype)) else "reference"
        if name == "reference" and device.type == "cuda" and not torch.compiler.is_compiling():
            _warn_reference_features(features)
        return name
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not one of {CHOICES}; pass one of them or None (automatic)")
    if backend not in honours:
        if set(features) <= set(BACKEND_FEATURES[backend]):  # it would honour them, but cannot run here
            raise ValueError(f"backend={backend!r} is not usable for tensors on {device} here (usable: "
                             f"{available_backends(device)}); install it, move the inputs to CUDA, or pass "
                             f"backend=None or one of {honours}")
        raise ValueError(f"backend={backend!r} cannot compute attention with {' and '.join(features)} (what each "
                         f"backend honours: {BACKEND_FEATURES}); pass backend=None or one of {honours}")
    return backend


_WARNED_FEATURES: set = set()


def _warn_reference_features(features: tuple[str, ...]) -> None:
    if features in _WARNED_FEATURES:
        return
    _WARNED_FEATURES.add(features)
    warnings.warn(
        f"packfwd attention: {' and '.join(features)} on CUDA run on the pure-PyTorch 'reference' backend, which "
        "pads every sequence to max_seqlen (memory and work ~ n * max_seqlen**2 per head); exact, but slow for long "
        "sequences.  In bfloat16 or float16 with torch >= 2.9 (and not batch_invariant) the automatic choice is 'flex', a compiled kernel "
        "that honours them",
        stacklevel=3,
    )


def choose_backend(device: torch.device | str, dtype: torch.dtype, head_dim: int, v_head_dim: int | None = None, *,
                   backend: str | None = None, features: tuple[str, ...] = ()) -> str:
    """The backend :func:`varlen_attention` runs for inputs of ``dtype`` on ``device`` with these head dims
    (``backend=None``: the automatic choice; ``features``: ``("window",)``, ``("sinks",)``, what the call needs).

    Automatic, on CUDA for fp16/bf16: the first flash kernel present; else the reference.  ``backend="prefer_cudnn"``
    (:data:`PREFER_CUDNN`): cuDNN's ragged attention when ``nvidia-cudnn-frontend`` is importable, the head dims are
    one value of at most 128 (the 1B step's attention: 20-22 ms against the flash kernel's 35-39 ms,
    benchmarks/RESULTS.md) and it has passed :func:`cudnn_check` on the device (run once per device and dtype: it
    reads a value back, so a first call under CUDA graph capture or ``torch.compile`` takes the flash kernel
    instead), else the automatic choice; not cuDNN under split-K control (``batch_invariant``: cuDNN plans per batch
    shape).  Not the automatic choice for a batch of its own shapes (cuDNN builds a graph per new shape); packfwd's
    attention asks it for a bucket plan's batch, whose shapes recur.  A layer with a window or sinks gets a backend
    that honours them.

    >>> choose_backend("cpu", torch.bfloat16, 128)
    'reference'
    """
    device = torch.device(device)
    return _resolve(backend, device, dtype, tuple(features), (head_dim, head_dim if v_head_dim is None else v_head_dim))


# cudnn_check's verdict per (device, dtype): the automatic choice reads it (a compiled call reads the plain dict).
_CUDNN_CHECKED: dict = {}


def _batch_invariance_asked(dtype: torch.dtype) -> bool:
    """Whether split-K is off for ``dtype``'s GEMMs (``batch_invariant=True`` turns it off): then no automatic
    choice takes a kernel whose bits depend on the batch (cuDNN's per-shape plans, flex's blocks over the whole
    packed buffer, where a sequence's keys fall in blocks by its offset)."""
    flag = "allow_bf16_reduced_precision_reduction_split_k" if dtype == torch.bfloat16 else \
        "allow_fp16_reduced_precision_reduction_split_k"
    return getattr(torch.backends.cuda.matmul, flag, True) is False


def _cudnn_is_automatic(device: torch.device, dtype: torch.dtype, d: int, d_v: int) -> bool:
    if device.type != "cuda" or d != d_v or d > 128 or d % 8 or _kernels()["cudnn"] is None:
        return False
    if _batch_invariance_asked(dtype):  # no kernel that plans per batch shape
        return False
    key = (device.index if device.index is not None else torch.cuda.current_device(), dtype)
    if key not in _CUDNN_CHECKED:
        if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing() or torch.cuda.get_sync_debug_mode():
            return False  # the check reads a value back: not here (an eager call makes it)
        _CUDNN_CHECKED[key] = cudnn_check(torch.device("cuda", key[0]), dtype)
    return _CUDNN_CHECKED[key]


def cudnn_check(device: torch.device | str, dtype: torch.dtype = torch.bfloat16) -> bool:
    """Whether cuDNN's ragged attention gives the reference's results on ``device`` (True) or not, or cannot run
    (False, with one warning): two causal sequences (grouped-query heads), forward and the gradients of q, k, v,
    within bf16 rounding.  One device read; :func:`choose_backend` calls it once per device and dtype."""
    device = torch.device(device)
    try:
        g = torch.Generator(device=device).manual_seed(0)
        cu = torch.tensor([0, 37, 160], dtype=torch.int32, device=device)
        with torch.inference_mode(False), torch.enable_grad():
            q, k, v = (torch.randn(160, h, 64, generator=g, device=device, dtype=dtype).requires_grad_()
                       for h in (4, 2, 2))
            w = torch.randn(160, 4, 64, generator=g, device=device, dtype=dtype)
            got = _cudnn(q, k, v, cu, cu, 123, 123, True, None)
            want = varlen_attention_reference(q, k, v, cu, cu, 123, 123, True)
            grads = [torch.autograd.grad((o.float() * w.float()).sum(), (q, k, v)) for o in (got, want)]
        pairs = [(got, want), *zip(*grads)]  # each compared relative to the reference's largest value
        err = max(float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-3)) for a, b in pairs)
        ok = err < 2e-2
        reason = f"differs from the reference by {err:.3g} of its largest value"
    except Exception as e:  # noqa: BLE001 - any failure: the automatic choice keeps the flash kernels
        ok, reason = False, f"{type(e).__name__}: {str(e).strip()[:200]}"
    if not ok:
        warnings.warn(f"packfwd attention: cuDNN's ragged attention failed its check on {device} ({reason}); the "
                      "automatic choice keeps the flash kernels", stacklevel=2)
    return ok


_WARNED_DTYPES: set = set()


def _warn_slow_dtype(dtype: torch.dtype, fast: str) -> None:
    if dtype in _WARNED_DTYPES:
        return
    _WARNED_DTYPES.add(dtype)
    warnings.warn(
        f"packfwd attention: {dtype} inputs on CUDA run on the pure-PyTorch 'reference' backend, which pads every "
        f"sequence to max_seqlen (work ~ n * max_seqlen**2 per head): the varlen kernels take fp16/bf16 only.  Run "
        f"the model in torch.bfloat16 (or float16) to use {fast!r}, or pass backend='reference' to choose it "
        "knowingly",
        stacklevel=3,
    )


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    backend: str | None = None,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Attention of packed sequences: ``q: [t_q, h, d]``, ``k: [t_k, h_kv, d]``, ``v: [t_k, h_kv, d_v]`` ->
    ``[t_q, h, d_v]``.

    ``cu_seqlens_q``/``cu_seqlens_k``: [n+1] int32 offsets of the n sequences; ``max_seqlen_q``/``_k``: Python
    ints at least the longest sequence; ``softmax_scale``: default ``d ** -0.5``.  ``d_v`` may differ from ``d``
    (multi-head latent attention): the flash kernels, which take one head dim, then get q, k and v zero-padded to
    the larger one (the scores and the first ``d_v`` output channels unchanged) and the output is cut back.
    ``backend``: see the module docstring; None picks the first of :func:`available_backends` that takes the inputs' dtype.
    ``window`` (an int >= 0, causal only) and ``sinks`` (``[h]``, one logit per query head): the sliding window and
    the sinks of the module docstring; None: none.
    Tokens of ``q`` past ``cu_seqlens_q[-1]``: zeros from the reference; the CUDA kernels leave those rows
    unwritten (packfwd's plans end ``cu_seqlens_padded`` at the last token, so its models have none).

    >>> import torch
    >>> q = k = v = torch.randn(5, 2, 4)
    >>> cu = torch.tensor([0, 3, 5], dtype=torch.int32)
    >>> out = varlen_attention(q, k, v, cu, cu, 3, 3)
    >>> out.shape, torch.allclose(out[3], v[3])   # the first token of a sequence sees only itself
    (torch.Size([5, 2, 4]), True)
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    features = _check_features(q, causal, window, sinks)
    name = _resolve(backend, q.device, q.dtype, features, (q.shape[-1], v.shape[-1]))
    if name == "reference":
        return varlen_attention_reference(
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
            window=window, sinks=sinks,
        )
    if name == "cudnn":
        return _cudnn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)
    if v.shape[-1] != q.shape[-1]:  # the flash kernels take one head dim: zeros appended (exact), the output cut
        width = max(q.shape[-1], v.shape[-1])
        wide = [torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (q, k, v)]
        scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
        return varlen_attention(*wide, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, scale,
                                backend=name, window=window, sinks=sinks)[..., : v.shape[-1]]
    if name == "flex":  # the window and sinks of GPT-OSS on CUDA (varlen_flex.py)
        return _KERNELS["flex"](q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, window=window, sinks=sinks)
    if name == "flash_attn":  # deterministic backward under torch's deterministic mode, as torch's own flash
        return _KERNELS["flash_attn"](  # recorded by _resolve
            q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
            dropout_p=0.0, softmax_scale=softmax_scale, causal=causal,
            **({"deterministic": True} if torch.are_deterministic_algorithms_enabled() else {}),
        )
    return _torch_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale)


def _torch_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    """``varlen_attn`` across its signatures: torch 2.10 has ``is_causal`` and no scale or GQA; later versions
    take ``window_size=(-1, 0)`` for causal, ``scale`` and ``enable_gqa``."""
    fn = _KERNELS["torch_varlen"]  # recorded by _resolve
    params = inspect.signature(fn).parameters
    kwargs = {}
    if "window_size" in params:
        kwargs["window_size"] = (-1, 0) if causal else (-1, -1)
    elif causal:
        kwargs["is_causal"] = True
    if softmax_scale is not None:
        if "scale" in params:
            kwargs["scale"] = softmax_scale
        else:  # fold the scale into q: the kernel multiplies by d ** -0.5 itself
            q = q * (softmax_scale * math.sqrt(q.shape[-1]))
    group = q.shape[1] // k.shape[1]
    if group > 1:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    return fn(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **kwargs)


def _cudnn(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale):
    """cuDNN's ragged attention with flash-attn's semantics.  Causal attention of equal ``cu_seqlens`` (self
    attention) takes cuDNN's top-left diagonal, which is flash-attn's bottom-right one there; other ``cu_seqlens``
    (context parallelism's chunks) take the bottom-right diagonal, as flash-attn.  The log-sum-exp the forward
    returns is what the backward consumes (cuDNN's op saves it): ``return_lse=True``, its value dropped here.
    Under torch's deterministic mode the backward asks cuDNN for its deterministic algorithm."""
    fn = _KERNELS["cudnn"]  # recorded by _resolve
    same = cu_q is cu_k  # equal offsets in two tensors take the bottom-right diagonal: the same mask there
    out, _ = fn(
        q, k, v, scale=q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale, is_causal=causal,
        causal_bottom_right=causal and not same, cu_seqlens_q=cu_q.to(torch.int32),
        cu_seqlens_kv=cu_k.to(torch.int32), max_seqlen_q=max(64, round_up(int(max_q), 64)),
        max_seqlen_kv=max(64, round_up(int(max_k), 64)), return_lse=True,
    )
    return out


def varlen_attention_reference(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = True,
    softmax_scale: float | None = None,
    *,
    window: int | None = None,
    sinks: Tensor | None = None,
) -> Tensor:
    """Pure-PyTorch varlen attention with flash-attn's semantics (see the module docstring); differentiable.

    Shapes as in :func:`varlen_attention`.  Each sequence is gathered into a ``[n, max_seqlen, ...]`` block and
    all blocks go through one ``scaled_dot_product_attention``: plain causal for causal self-attention (equal
    ``cu_seqlens``: the padding slots of a block come after its real tokens), else masked (real keys, causal
    aligned bottom-right); the work is ``n * max_seqlen_q * max_seqlen_k`` per head.  Tokens of ``q`` past
    ``cu_seqlens_q[-1]`` get zeros.  With ``window`` or ``sinks`` (module docstring) the blocks' scores are formed
    explicitly: the window and causal masks in each sequence's own positions, the sink a last column of each
    head's scores that the softmax normalises over and the values never read.

    >>> import torch
    >>> q = torch.randn(4, 2, 8); k = v = torch.randn(4, 1, 8)          # 2 query heads share 1 kv head
    >>> cu = torch.tensor([0, 4], dtype=torch.int32)
    >>> dense = torch.nn.functional.scaled_dot_product_attention(
    ...     q.transpose(0, 1), k.transpose(0, 1).expand(2, 4, 8), v.transpose(0, 1).expand(2, 4, 8),
    ...     is_causal=True).transpose(0, 1)
    >>> torch.allclose(varlen_attention_reference(q, k, v, cu, cu, 4, 4), dense, atol=1e-6)
    True
    """
    _check_inputs(q, k, v, cu_seqlens_q, cu_seqlens_k)
    features = _check_features(q, causal, window, sinks)
    t_q, h, d = q.shape
    h_kv, d_v = k.shape[1], v.shape[2]
    n = cu_seqlens_q.numel() - 1
    if t_q == 0 or n == 0 or k.shape[0] == 0:
        return q.new_zeros(t_q, h, d_v)
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    cu_q, cu_k = cu_seqlens_q.to(q.device, torch.long), cu_seqlens_k.to(q.device, torch.long)
    len_q, len_k = cu_q.diff(), cu_k.diff()
    rows_q, valid_q = _block_rows(cu_q, max_seqlen_q, t_q)  # [n, Mq]
    rows_k, valid_k = _block_rows(cu_k, max_seqlen_k, k.shape[0])  # [n, Mk]

    def blocks(x, rows):  # [t, heads, d] -> [n, heads, M, d]
        return x.to(work).index_select(0, rows.reshape(-1)).reshape(*rows.shape, *x.shape[1:]).transpose(1, 2)

    qb, kb, vb = blocks(q, rows_q), blocks(k, rows_k), blocks(v, rows_k)
    if h != h_kv:
        kb, vb = kb.repeat_interleave(h // h_kv, dim=1), vb.repeat_interleave(h // h_kv, dim=1)

    if features:
        out = _explicit_blocks(qb, kb, vb, valid_q, valid_k, len_q, len_k, causal, scale, window, sinks)
    elif causal and max_seqlen_q == max_seqlen_k and (cu_seqlens_q is cu_seqlens_k or torch.equal(cu_q, cu_k)):
        # Self-attention: each block's padding slots sit after its real tokens, so plain causal attention over
        # the block is exact for the real queries (they never reach a padding key); padding rows are dropped.
        out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, is_causal=True, scale=scale)
    else:
        out = _masked_blocks(qb, kb, vb, valid_q, valid_k, len_q, len_k, causal, scale)
    out = out.transpose(1, 2).reshape(n * max_seqlen_q, h, d_v)  # block slots, sequence after sequence

    token = torch.arange(t_q, device=q.device)
    seq = torch.searchsorted(cu_q[1:], token, right=True)  # sequence of each token (n past the end)
    inside = seq < n
    seq = seq.clamp(max=n - 1)
    pos = (token - cu_q[seq]).clamp(0, max_seqlen_q - 1)
    res = out.index_select(0, seq * max_seqlen_q + pos) * inside[:, None, None]
    return res.to(q.dtype)


def _masked_blocks(qb, kb, vb, valid_q, valid_k, len_q, len_k, causal: bool, scale: float) -> Tensor:
    """Blocks [n, h, M, d] attended under the mask of real keys (and bottom-right causal): [n, h, Mq, d_v]."""
    mq, mk = qb.shape[2], kb.shape[2]
    allowed = valid_q[:, :, None] & valid_k[:, None, :]  # [n, Mq, Mk]
    if causal:
        i = torch.arange(mq, device=qb.device)[None, :, None]
        j = torch.arange(mk, device=qb.device)[None, None, :]
        allowed = allowed & (j <= i + (len_k - len_q)[:, None, None])
    # A query that sees no key (a padding slot of the block, or flash-attn's "no key yet" under bottom-right
    # causal) gets key 0 so the softmax stays finite; its output is zeroed just after.
    has_key = allowed.any(-1)  # [n, Mq]
    allowed = allowed | (~has_key[:, :, None] & (torch.arange(mk, device=qb.device) == 0))
    out = torch.nn.functional.scaled_dot_product_attention(qb, kb, vb, attn_mask=allowed[:, None], scale=scale)
    return out * has_key[:, None, :, None]


def _explicit_blocks(qb, kb, vb, valid_q, valid_k, len_q, len_k, causal: bool, scale: float, window, sinks) -> Tensor:
    """Blocks [n, h, M, d] attended with a sliding window and/or sinks, scores formed explicitly: [n, h, Mq, d_v].
    A query with no key in reach (and no sink) outputs zeros, as flash-attn's; with a sink it outputs zeros too
    (all its weight on the sink)."""
    mq, mk = qb.shape[2], kb.shape[2]
    scores = torch.matmul(qb, kb.transpose(-1, -2)) * scale  # [n, h, Mq, Mk]
    allowed = valid_q[:, :, None] & valid_k[:, None, :]  # [n, Mq, Mk]
    i = torch.arange(mq, device=qb.device)[None, :, None]
    j = torch.arange(mk, device=qb.device)[None, None, :]
    diagonal = i + (len_k - len_q)[:, None, None]  # query i's own position among its keys (bottom-right)
    if causal:
        allowed = allowed & (j <= diagonal)
    if window is not None:
        allowed = allowed & (j >= diagonal - window)
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    if sinks is not None:  # one more column per head: the sink's logit, normalised over and never read
        column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:3], 1)
        scores = torch.cat([scores, column], dim=-1)
    top = scores.amax(-1, keepdim=True)
    top = torch.where(torch.isfinite(top), top, torch.zeros_like(top)).detach()  # no key and no sink: all -inf
    weights = torch.exp(scores - top)
    total = weights.sum(-1, keepdim=True)
    out = torch.matmul(weights[..., :mk], vb)
    return out / torch.where(total > 0, total, torch.ones_like(total))  # no key, no sink: 0 / 1


def _check_features(q: Tensor, causal: bool, window, sinks) -> tuple[str, ...]:
    """The features a call asks for (``BACKEND_FEATURES``' names), checked."""
    if window is not None:
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ValueError(f"window={window!r}: pass an int >= 0 (keys at most that many positions before the "
                             "query) or None")
        if not causal:
            raise ValueError("window= with causal=False: packfwd's sliding window is causal (flash-attn's "
                             "window_size=(window, 0)); pass causal=True")
    if sinks is not None and (not isinstance(sinks, Tensor) or sinks.shape != (q.shape[1],)
                              or not sinks.dtype.is_floating_point):
        raise ValueError(f"sinks must be a float tensor [h] of one logit per query head (h={q.shape[1]}), got "
                         f"{getattr(sinks, 'shape', type(sinks))}")
    return (("window",) if window is not None else ()) + (("sinks",) if sinks is not None else ())


def _block_rows(cu: Tensor, width: int, total: int) -> tuple[Tensor, Tensor]:
    """[n, width] token row of each (sequence, position) slot (clamped into range) and whether it is real."""
    pos = torch.arange(width, device=cu.device)
    valid = pos[None, :] < cu.diff()[:, None]
    rows = (cu[:-1, None] + pos[None, :]).clamp(0, max(total - 1, 0))
    return rows, valid


def _check_inputs(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> None:
    for name, x in (("q", q), ("k", k), ("v", v)):
        if not isinstance(x, Tensor) or x.dim() != 3:
            raise ValueError(f"{name} must be a [tokens, heads, head_dim] tensor, got {getattr(x, 'shape', type(x))}")
    if k.shape[:2] != v.shape[:2] or q.shape[2] != k.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} / v {tuple(v.shape)} do not match q {tuple(q.shape)}: k and v need "
                         "the same tokens and heads, q and k the same head_dim")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1]:
        raise ValueError(f"q has {q.shape[1]} heads and k has {k.shape[1]}; the kv heads must divide the q heads")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point:
            raise ValueError(f"{name} must be a 1-D integer tensor [n+1] (int32 offsets)")
    if cu_q.numel() != cu_k.numel() or cu_q.numel() < 1:
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k must both have n+1 >= 1 entries, got {cu_q.numel()}, {cu_k.numel()}"
        )
