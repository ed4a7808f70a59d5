"""Running Megatron-Core's GPT modules on a CPU: everything packfwd does differently there, in one place.

Megatron-Core assumes CUDA in a few spots that packfwd's models meet; on a CUDA device none of this applies and
the modules run exactly as Megatron-Core ships them.

1. Parameter allocation.  With ``use_cpu_initialization=False`` every tensor-parallel linear and embedding
   allocates its weight on ``torch.cuda.current_device()``.  On the CPU packfwd sets the config flag
   ``use_cpu_initialization=True`` (:func:`config_overrides`), Megatron's own switch: weights are created and
   initialised on the host with torch's default generator, no CUDA RNG tracker involved.
2. Rotary embeddings.  ``RotaryEmbedding.get_emb`` moves its ``inv_freq`` to ``torch.cuda.current_device()``
   on every call while it sits on the CPU.  :func:`keep_rotary_on_host` gives the model's rotary module a
   subclass whose ``get_emb`` computes the same table on ``inv_freq``'s own device.
3. The CUDA RNG tracker (``model_parallel_cuda_manual_seed``).  Megatron draws from it to initialise weights on
   the GPU and for dropout in tensor-parallel regions.  On the CPU nothing draws from it (point 1, and packfwd's
   configs have no dropout); on CUDA :func:`ensure_cuda_rng_tracker` seeds it once when no one has.  Under
   sequence parallelism Megatron still *enters* the tracker around its (zero) dropouts, which reads CUDA RNG
   states; for a model on the CPU, :func:`ensure_host_rng_tracker` installs Megatron's own inference tracker
   (``initialize_rng_tracker(inference_rng_tracker=True)``, whose ``fork`` does nothing) when no states exist.
4. Megatron's ``DotProductAttention`` takes its scratch buffer from a global CUDA memory buffer; packfwd's
   layer spec replaces it with :class:`packfwd.attention.CoreAttention`, so it is never built.
5. Communication buffers.  Megatron's sequence-parallel all-gathers and reduce-scatters (and its global memory
   buffer) allocate on ``torch.cuda.current_device()``.  Inside :func:`host_collectives` that returns the CPU
   device, so gloo gathers into host tensors.  A sequence-parallel model built on the CPU enters it around its
   own forward (:func:`run_forward_on_host`); run the backward inside it yourself (``with host_collectives():
   loss.backward()``; :func:`packfwd.parallel.pipeline_forward_backward` does).  Tensor parallelism without
   sequence parallelism, and context parallelism, need none of this.

A model built on one device runs there: build on the device you use (``device=`` of the builders).
"""

from __future__ import annotations

import contextlib
import functools
import threading

import torch

__all__ = [
    "config_overrides",
    "ensure_cuda_rng_tracker",
    "ensure_host_rng_tracker",
    "host_collectives",
    "is_host",
    "keep_rotary_on_host",
    "run_forward_on_host",
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


@functools.lru_cache(maxsize=None)
def _host_rotary_class():
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    class HostRotaryEmbedding(RotaryEmbedding):
        """Megatron-Core's ``RotaryEmbedding`` whose table is computed where ``inv_freq`` lives."""

        def get_emb(self, max_seq_len: int, offset: int = 0) -> torch.Tensor:
            freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, d/2]
            if self.rotary_interleaved:
                emb = torch.stack((freqs, freqs), dim=-1).reshape(freqs.shape[0], -1)
            else:
                emb = torch.cat((freqs, freqs), dim=-1)
            return emb[:, None, None, :]  # [s, 1, 1, d]

    return HostRotaryEmbedding


def keep_rotary_on_host(model: torch.nn.Module) -> torch.nn.Module:
    """Point 2 of the module docstring, in place; returns ``model``.  Only modules whose ``inv_freq`` is on the
    CPU change; the rest (and every other module) are left as they are.

    The swapped ``get_emb`` returns what Megatron's returns (the ``[s, 1, 1, d]`` angle table), computed on the
    CPU instead of after a move to CUDA.

    >>> from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    >>> rope = RotaryEmbedding(kv_channels=8, rotary_percent=1.0, use_cpu_initialization=True)
    >>> keep_rotary_on_host(torch.nn.Sequential(rope))[0].get_emb(4).shape
    torch.Size([4, 1, 1, 8])
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    host_class = _host_rotary_class()
    for module in model.modules():
        if type(module) is RotaryEmbedding and is_host(module.inv_freq.device):
            module.__class__ = host_class
    return model


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


_HOST_LOCK = threading.RLock()


def _host_current_device() -> torch.device:
    return torch.device("cpu")


@contextlib.contextmanager
def host_collectives():
    """Point 5 of the module docstring: inside, ``torch.cuda.current_device()`` returns the CPU device.

    Enter it around the forward and the backward of a sequence-parallel model that lives on the CPU (the model's
    own forward enters it by itself, see :func:`run_forward_on_host`).  It replaces a function of ``torch.cuda``
    for the duration, process-wide: do not run CUDA work in other threads meanwhile.  Re-entrant.

    >>> with host_collectives():
    ...     torch.empty(2, device=torch.cuda.current_device()).device
    device(type='cpu')
    """
    with _HOST_LOCK:
        saved = torch.cuda.current_device
        torch.cuda.current_device = _host_current_device
        try:
            yield
        finally:
            torch.cuda.current_device = saved


def run_forward_on_host(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model``'s forward run inside :func:`host_collectives` (forward hooks, in place); returns ``model``.

    >>> class Where(torch.nn.Module):
    ...     def forward(self):
    ...         return torch.cuda.current_device()
    >>> run_forward_on_host(Where())()
    device(type='cpu')
    """
    state = threading.local()

    def enter(module, args):
        stack = getattr(state, "stack", None) or []
        context = host_collectives()
        context.__enter__()
        stack.append(context)
        state.stack = stack

    def leave(module, args, output):
        state.stack.pop().__exit__(None, None, None)

    model.register_forward_pre_hook(enter)
    model.register_forward_hook(leave, always_call=True)
    return model
