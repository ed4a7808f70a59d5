"""Running Megatron-Core's GPT modules on a CPU: everything packfwd does differently there, in one place.

Megatron-Core assumes CUDA in a few spots that packfwd's models meet; on a CUDA device none of this applies and
the modules run exactly as Megatron-Core ships them.

1. Parameter allocation.  With ``use_cpu_initialization=False`` every tensor-parallel linear and embedding
   allocates its weight on ``torch.cuda.current_device()``.  On the CPU packfwd sets the config flag
   ``use_cpu_initialization=True`` (:func:`config_overrides`), Megatron's own switch: weights are created and
   initialised on the host with torch's default generator, no CUDA RNG tracker involved.
2. Rotary embeddings.  ``RotaryEmbedding.get_emb`` moves its ``inv_freq`` to ``torch.cuda.current_device()``
   on every call while it sits on the CPU.  packfwd's models are built with
   :class:`packfwd.models.mixers.rope.PackedRotaryEmbedding`, whose ``get_emb`` computes the same table on
   ``inv_freq``'s own device (the CPU when the config says ``use_cpu_initialization``, point 1).
3. The CUDA RNG tracker (``model_parallel_cuda_manual_seed``).  Megatron draws from it to initialise weights on
   the GPU and for dropout in tensor-parallel regions.  On the CPU nothing draws from it (point 1, and packfwd's
   configs have no dropout); on CUDA :func:`ensure_cuda_rng_tracker` seeds it once when no one has.  Under
   sequence parallelism Megatron still *enters* the tracker around its (zero) dropouts, which reads CUDA RNG
   states; for a model on the CPU, :func:`ensure_host_rng_tracker` installs Megatron's own inference tracker
   (``initialize_rng_tracker(inference_rng_tracker=True)``, whose ``fork`` does nothing) when no states exist.
4. Megatron's ``DotProductAttention`` takes its scratch buffer from a global CUDA memory buffer; packfwd's
   layer spec replaces it with :class:`packfwd.models.mixers.attention.CoreAttention`, so it is never built.
5. Communication buffers.  Megatron's sequence-parallel all-gathers and reduce-scatters (and its global memory
   buffer) allocate on ``torch.cuda.current_device()``.  Inside :func:`host_collectives` that returns the CPU
   device, so gloo gathers into host tensors (it lives in :mod:`packfwd.parallel.host`, below the models, for
   the pipeline schedule enters it too; re-exported here).  A sequence-parallel model built for the CPU runs its own forward
   inside it (``packfwd.models.runtime.model.PackedGPTModel`` decides so at construction); run the backward inside it
   yourself (``with host_collectives(): loss.backward()``; :func:`packfwd.parallel.pipeline_forward_backward`
   does).  Tensor parallelism without
   sequence parallelism, and context parallelism, need none of this.

A model built on one device runs there: build on the device you use (``device=`` of the builders).
"""

from __future__ import annotations

import torch

from packfwd.parallel.host import host_collectives

__all__ = [
    "config_overrides",
    "ensure_cuda_rng_tracker",
    "ensure_host_rng_tracker",
    "host_collectives",
    "is_host",
]


def is_host(device: torch.device | str) -> bool:
    """True for a CPU device: the one place where this module's adaptations apply.

    >>> is_host("cpu"), is_host("cuda:0")
    (True, False)
    """
    return torch.device(device).type == "cpu"


def config_overrides(device: torch.device | str) -> dict:
    """``TransformerConfig`` fields that place a model on ``device`` (point 1 of the module docstring).

    >>> config_overrides("cpu"), config_overrides("cuda")
    ({'use_cpu_initialization': True}, {'use_cpu_initialization': False})
    """
    return {"use_cpu_initialization": is_host(device)}


def ensure_cuda_rng_tracker(seed: int = 1234) -> None:
    """Seed Megatron-Core's CUDA RNG tracker if no one has (point 3); does nothing without CUDA.

    When it seeds, it does so with Megatron's ``model_parallel_cuda_manual_seed(seed)``, which also seeds the
    default CUDA generator; seed the tracker yourself first to choose the seeds.

    >>> ensure_cuda_rng_tracker()  # idempotent: a second call leaves the tracker as it is
    """
    if not torch.cuda.is_available():
        return
    from megatron.core.tensor_parallel.random import (
        get_cuda_rng_tracker,
        initialize_rng_tracker,
        model_parallel_cuda_manual_seed,
    )

    tracker = get_cuda_rng_tracker()
    if not tracker.get_states():
        if getattr(tracker, "is_inference_rng_tracker", False):  # ensure_host_rng_tracker's: it keeps no states
            initialize_rng_tracker(force_reset=True)
        model_parallel_cuda_manual_seed(seed)


def ensure_host_rng_tracker() -> None:
    """Point 3 for a model on the CPU: if Megatron-Core's RNG tracker holds no states, replace it by Megatron's
    inference tracker (its ``fork`` is a no-op), so that sequence-parallel regions run without CUDA.  A tracker
    that someone seeded is left alone.

    >>> ensure_host_rng_tracker()
    >>> from megatron.core.tensor_parallel.random import get_cuda_rng_tracker
    >>> with get_cuda_rng_tracker().fork():   # no CUDA RNG state is read
    ...     pass
    """
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker, initialize_rng_tracker

    if not get_cuda_rng_tracker().get_states():
        initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)
