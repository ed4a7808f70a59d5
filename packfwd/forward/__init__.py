"""The forward factory (``make_forward``); see :mod:`packfwd.forward.factory`."""

from .factory import make_forward as make_forward
