"""Batch invariance and a deterministic backward: the torch / cuBLAS state they need and the checks
``make_forward(..., batch_invariant=True, deterministic=True)`` runs before each call.

What each option promises (docs/guarantees.md has the full statement, the test that keeps each point, and what
is still to be measured on a GPU):

* ``batch_invariant=True`` (CUDA, ``data_format="thd"``, ``tp_size=1``): a sequence's forward outputs (logits,
  log-probs, entropy, values; the fused head too) are the same bits whatever it is packed with: alone, after or
  between others, in any micro-batch.  packfwd's own pieces are row-wise by construction (the plan's gather, the
  per-sequence varlen attention, the one-program-per-row log-prob kernels, the fused head's vocab blocks aligned to
  its kernel's step); what can still depend on the packed token count ``t`` is the GEMMs, whose ``M`` is ``t``:
  cuBLAS picks a kernel per shape and may split the reduction over ``K`` (split-K), which changes the rounding.
  The option therefore needs split-K off: ``torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction =
  (False, False)`` (fp16 too; torch >= 2.10) with the cuBLASLt backend, which torch needs to honour it (it then
  asks cuBLASLt for kernels with ``CUBLASLT_REDUCTION_SCHEME_NONE``), and every sequence aligned to
  :data:`INVARIANT_MIN_ROWS` rows (``make_forward`` sets ``seq_align``: :func:`invariant_seq_align`), so no batch is
  smaller than a GEMM tile's rows.  On the CPU the GEMMs block by the batch size and nothing turns that off:
  refused there (outputs agree within rounding, see the tests).
* ``deterministic=True``: parameter gradients of the same batch are the same bits run after run.  packfwd's own
  backward passes are deterministic by construction (a plan's gather is a partial bijection, so its backward is the
  inverse gather: every gradient row written once, no atomics; the Triton kernels use none); what is not, on
  CUDA, is torch's: flash attention's backward accumulates ``dq`` with atomics unless torch's deterministic mode
  is on when the backward runs (torch reads it then), and so do ``index_add`` / ``index_select``'s backward (the
  reference attention) and, for few distinct ids, the embedding backward.  The option therefore needs
  ``torch.use_deterministic_algorithms(True)`` (not ``warn_only``), kept on through the backward, and on CUDA
  ``CUBLAS_WORKSPACE_CONFIG`` set to ``:4096:8`` or ``:16:8`` (torch's requirement for deterministic cuBLAS).

Neither option changes global state: each checks it at every call and raises, naming the fix.  Set it once at
the start of the process with :func:`enable` (or scope it with :func:`enabled`, as the tests do).

>>> check("cpu", deterministic=False, batch_invariant=False)           # nothing asked: nothing checked
>>> check("cpu", deterministic=False, batch_invariant=True)            # doctest: +ELLIPSIS
Traceback (most recent call last):
ValueError: batch_invariant=True is a CUDA guarantee ...
"""

from __future__ import annotations

import contextlib
import functools
import math
import os

import torch

from .._validate import check_bool

__all__ = ["INVARIANT_MIN_ROWS", "WORKSPACE_CONFIGS", "check", "check_layout", "enable", "enabled", "guarded",
           "invariant_seq_align", "restore", "state"]

# Under batch_invariant=True no packed batch has fewer rows than this: every sequence is aligned to a multiple of
# it.  On an H200 a lone 1-token sequence (GEMM M = 1) took other cuBLAS kernels than any batch of 33 or more rows
# (its logits 0.0176 off: tests/gpu/test_batch_invariance_cuda.py at 1b81660), and cuBLAS serves M = 1 with GEMV
# kernels; 16 rows is one tensor-core tile row block, what every larger batch's kernels take.
INVARIANT_MIN_ROWS = 16

# The cuBLAS workspace settings torch accepts under deterministic algorithms (cuBLAS's reproducibility note).
WORKSPACE_CONFIGS = (":4096:8", ":16:8")


def state() -> dict:
    """The process-wide settings the two guarantees read (a dict; :func:`restore` takes it back)."""
    out = dict(
        deterministic=torch.are_deterministic_algorithms_enabled(),
        warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
        fill_uninitialized_memory=torch.utils.deterministic.fill_uninitialized_memory,
        cublas_workspace_config=os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        blas=_blas_name(),
    )
    out.update(_reduction_flags())
    return out


def enable(*, batch_invariant: bool = True, deterministic: bool = True) -> dict:
    """Set the state the guarantees need, for the whole process; returns the previous :func:`state`.

    ``deterministic``: ``torch.use_deterministic_algorithms(True)``; ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` unless one of
    :data:`WORKSPACE_CONFIGS` is set (cuBLAS reads it when it first allocates its workspace: call this before the
    first CUDA matmul); uninitialised memory is not filled (deterministic mode fills every ``torch.empty`` with NaN
    otherwise, a pass over memory that packfwd never reads unwritten).  ``batch_invariant`` (CUDA): split-K off
    for bf16 and fp16 GEMMs and the cuBLASLt backend (see the module docstring).
    """
    previous = state()
    if deterministic:
        if os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in WORKSPACE_CONFIGS:
            os.environ["CUBLAS_WORKSPACE_CONFIG"] = WORKSPACE_CONFIGS[0]
        torch.use_deterministic_algorithms(True)
        torch.utils.deterministic.fill_uninitialized_memory = False
    if batch_invariant:
        if not _has_split_k_control():
            raise RuntimeError(f"batch_invariant needs torch >= 2.10 (split-K control of cuBLAS); this is "
                               f"{torch.__version__}")
        matmul = torch.backends.cuda.matmul
        matmul.allow_bf16_reduced_precision_reduction = (False, False)
        matmul.allow_fp16_reduced_precision_reduction = (False, False)
        if torch.cuda.is_available():
            torch.backends.cuda.preferred_blas_library("cublaslt")
    return previous


def restore(previous: dict) -> None:
    """Put back a :func:`state` (as :func:`enable` returned it)."""
    torch.use_deterministic_algorithms(previous["deterministic"], warn_only=previous["warn_only"])
    torch.utils.deterministic.fill_uninitialized_memory = previous["fill_uninitialized_memory"]
    if previous["cublas_workspace_config"] is None:
        os.environ.pop("CUBLAS_WORKSPACE_CONFIG", None)
    else:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = previous["cublas_workspace_config"]
    if "bf16_split_k" in previous:
        matmul = torch.backends.cuda.matmul
        matmul.allow_bf16_reduced_precision_reduction = (previous["bf16_reduced"], previous["bf16_split_k"])
        matmul.allow_fp16_reduced_precision_reduction = (previous["fp16_reduced"], previous["fp16_split_k"])
    if torch.cuda.is_available() and previous["blas"] != _blas_name():
        torch.backends.cuda.preferred_blas_library(previous["blas"])


@contextlib.contextmanager
def enabled(*, batch_invariant: bool = True, deterministic: bool = True):
    """:func:`enable` for the ``with`` block, then :func:`restore` (tests, benchmarks).  Keep the backward inside."""
    previous = enable(batch_invariant=batch_invariant, deterministic=deterministic)
    try:
        yield
    finally:
        restore(previous)


def invariant_seq_align(seq_align: int | None, cp_size: int, tp_size: int) -> int:
    """THD's per-sequence alignment under ``batch_invariant=True``: None gives the smallest multiple of
    :data:`INVARIANT_MIN_ROWS` the layout takes; a given one must be a multiple of it (ValueError otherwise).

    >>> invariant_seq_align(None, 1, 1), invariant_seq_align(None, 3, 1), invariant_seq_align(64, 2, 2)
    (16, 48, 64)
    """
    if seq_align is None:
        return math.lcm(INVARIANT_MIN_ROWS, 2 * cp_size if cp_size > 1 else 1, tp_size)
    if not isinstance(seq_align, int) or isinstance(seq_align, bool) or seq_align % INVARIANT_MIN_ROWS:
        raise ValueError(
            f"seq_align={seq_align!r} with batch_invariant=True: every sequence must be aligned to a multiple of "
            f"{INVARIANT_MIN_ROWS} rows (a batch of fewer rows takes other GEMM kernels than larger ones, e.g. a lone "
            f"1-token sequence); pass a multiple of {INVARIANT_MIN_ROWS}, or None for the smallest valid one")
    return seq_align


def check_layout(data_format: str, tp_size: int, *, deterministic, batch_invariant) -> None:
    """``make_forward``'s eager checks of the two options (types; layouts the guarantee is not built for)."""
    for name, value in (("deterministic", deterministic), ("batch_invariant", batch_invariant)):
        check_bool(name, value)
    if batch_invariant and data_format != "thd":
        raise ValueError("batch_invariant=True is built and tested for data_format='thd' (BSHD pads every row to the "
                         "longest, so a row's shapes change with the batch); use data_format='thd'")
    if batch_invariant and tp_size > 1:
        raise ValueError("batch_invariant=True with tp_size > 1: the vocab-parallel log-probs reduce with torch "
                         "kernels whose split depends on the row count, and the TP all-reduces' order on NCCL's "
                         "algorithm; not built: use tp_size=1")


def guarded(forward, *, deterministic: bool, batch_invariant: bool):
    """``forward`` itself when neither option is asked for; else a forward that runs :func:`check` on the device of
    its ``input_ids`` first (``functools.wraps``: attributes such as ``layout`` carry over)."""
    if not (deterministic or batch_invariant):
        return forward

    @functools.wraps(forward)
    def checked(model, input_ids, *args, **kwargs):
        check(input_ids.device, deterministic=deterministic, batch_invariant=batch_invariant)
        if batch_invariant:
            check_attention(model)
        return forward(model, input_ids, *args, **kwargs)

    return checked


def check_attention(model) -> None:
    """Raise for an attention backend whose kernel choice follows the batch: cuDNN plans per ``(n, max_seqlen)``
    of the batch, so a sequence's bits may depend on what it is packed with (the flash kernels are per sequence)."""
    if any(getattr(m, "backend", None) == "cudnn" for m in model.modules()):
        raise ValueError("batch_invariant=True is not promised with attention_backend='cudnn' (cuDNN picks its "
                         "kernel per batch shape); build the model with attention_backend=None or 'torch_varlen'")
    if any(getattr(m, "window", None) is not None or getattr(m, "softmax_offset", None) is not None
           for m in model.modules()):
        raise ValueError("batch_invariant=True is not promised for attention with a sliding window or sinks "
                         "(GPT-OSS): the backends that honour them tile the batch, not each sequence ('flex': blocks "
                         "of the packed row; the reference: every sequence padded to the batch's max_seqlen); pass "
                         "batch_invariant=False")


def check(device, *, deterministic: bool, batch_invariant: bool) -> None:
    """Raise (naming the fix) unless the process state gives what the options promise for inputs on ``device``."""
    cuda = torch.device(device).type == "cuda"
    if batch_invariant and not cuda:
        raise ValueError(
            "batch_invariant=True is a CUDA guarantee (cuBLASLt without split-K); on the CPU the GEMMs block by the "
            "batch size and outputs agree only within rounding: drop batch_invariant on the CPU"
        )
    if batch_invariant:
        flags = _reduction_flags()
        if not flags or flags["bf16_split_k"] or flags["fp16_split_k"] or _blas_name() != "cublaslt":
            raise RuntimeError(
                "batch_invariant=True needs cuBLAS split-K off and the cuBLASLt backend (split-K reductions depend on "
                f"the packed token count); now {flags or 'torch < 2.10'}, blas={_blas_name()}: call "
                "packfwd.forward.deterministic.enable() at the start of the process"
            )
    if deterministic:
        if not torch.are_deterministic_algorithms_enabled() or torch.is_deterministic_algorithms_warn_only_enabled():
            raise RuntimeError(
                "deterministic=True needs torch.use_deterministic_algorithms(True) (not warn_only), on through the "
                "backward (flash attention's backward reads it when it runs): call "
                "packfwd.forward.deterministic.enable() at the start of the process"
            )
        if cuda and os.environ.get("CUBLAS_WORKSPACE_CONFIG") not in WORKSPACE_CONFIGS:
            raise RuntimeError(
                f"deterministic=True on CUDA needs CUBLAS_WORKSPACE_CONFIG in {WORKSPACE_CONFIGS} (torch's condition "
                "for deterministic cuBLAS), set before the first CUDA matmul: export it, or call "
                "packfwd.forward.deterministic.enable() first"
            )


def _has_split_k_control() -> bool:
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction_split_k
    except AttributeError:  # torch < 2.10
        return False
    return True


def _reduction_flags() -> dict:
    if not _has_split_k_control():
        return {}
    m = torch.backends.cuda.matmul
    return dict(bf16_reduced=m.allow_bf16_reduced_precision_reduction,
                bf16_split_k=m.allow_bf16_reduced_precision_reduction_split_k,
                fp16_reduced=m.allow_fp16_reduced_precision_reduction,
                fp16_split_k=m.allow_fp16_reduced_precision_reduction_split_k)


def _blas_name() -> str:
    return str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1].lower()
