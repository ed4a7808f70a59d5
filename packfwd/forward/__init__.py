"""The forward factory (``make_forward``, the one public name; :mod:`packfwd.forward.factory`) and the engine
extensions it composes: multi-token prediction (:mod:`~packfwd.forward.mtp`), the MoE aux loss
(:mod:`~packfwd.forward.moe`), the vision hook (:mod:`~packfwd.forward.vision`), the fused head
(:mod:`~packfwd.forward.head`), scored tokens only (:mod:`~packfwd.forward.scored`), the determinism guarantees
(:mod:`~packfwd.forward.deterministic`)."""

from .factory import make_forward as make_forward

__all__ = ["make_forward"]
