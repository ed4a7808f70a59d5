"""Helpers for packfwd's tests, doctests and notebooks, not the library proper.

:func:`run_local` (:mod:`packfwd.testing.launch`) runs a function on N local processes joined in one
``torch.distributed`` group (gloo on CPU, NCCL with one GPU per rank); the multi-process tests and examples use
it; a failing rank raises :class:`RankError`.  Production runs start their ranks with torchrun or a trainer's own
launcher.  :class:`OneHotModel` is a stand-in model for examples of the forwards.
"""

from .launch import RankError as RankError
from .launch import run_local as run_local
from .toys import OneHotModel as OneHotModel

__all__ = ["OneHotModel", "RankError", "run_local"]
