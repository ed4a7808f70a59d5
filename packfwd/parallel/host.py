"""Megatron's collectives for a model on the CPU: :func:`host_collectives`.

Megatron's sequence-parallel all-gathers and reduce-scatters (and its global memory buffer) allocate their
buffers on ``torch.cuda.current_device()``.  Inside :func:`host_collectives` that returns the CPU device, so gloo
gathers into host tensors (:mod:`packfwd.models.runtime.cpu`, point 5, says where packfwd's models need it).  Pure torch:
this module imports no Megatron-Core and no other packfwd module.
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = ["host_collectives"]

_HOST_LOCK = threading.RLock()


def _host_current_device() -> torch.device:
    return torch.device("cpu")


@contextlib.contextmanager
def host_collectives():
    """Inside, ``torch.cuda.current_device()`` returns the CPU device.

    Enter it around the backward of a sequence-parallel model that lives on the CPU (packfwd's models enter it
    around their forward by themselves; :func:`packfwd.parallel.pipeline_forward_backward` around both).  It
    replaces a function of ``torch.cuda`` for the duration, process-wide: do not run CUDA work in other threads
    meanwhile.  Re-entrant.

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
