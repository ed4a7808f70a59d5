"""packfwd's model families: one declarative entry each (:mod:`~packfwd.models.families.family`).

Importing this package does not import Megatron-Core.
"""

__all__: list[str] = []
