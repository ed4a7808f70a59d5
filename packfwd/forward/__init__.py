"""The forward factory (``make_forward``, the one public name); see :mod:`packfwd.forward.factory`."""

from .factory import make_forward as make_forward

__all__ = ["make_forward"]
