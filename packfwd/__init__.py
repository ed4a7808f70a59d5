"""packfwd: pure packing transforms and Megatron-Core forwards for variable-length batches.

Shapes: ``b`` batch, ``s`` padded length, ``t`` packed tokens, ``h`` heads, ``d`` head dim, ``v`` vocab.

The names here (``__all__``) are docs/api.md's first table: the layouts and their plans, RoPE positions and labels
through them, pipeline layer placement and ``make_forward``.  The rest lives in the subpackages, each with its own
``__all__``: ``layout`` (also multi-token prediction labels and the alignment rules), ``models``, ``micro``,
``parallel``, ``vision``, ``verl``, ``logits``, ``viz`` (pictures) and ``testing`` (the multi-process launcher).
"""

from .layout import BshdInfo as BshdInfo
from .layout import ThdInfo as ThdInfo
from .layout import UnpadInfo as UnpadInfo
from .layout import default_seq_align as default_seq_align
from .layout import from_bshd as from_bshd
from .layout import from_thd as from_thd
from .layout import next_token_labels as next_token_labels
from .layout import pack_positions as pack_positions
from .layout import pad as pad
from .layout import plan_bshd as plan_bshd
from .layout import plan_thd as plan_thd
from .layout import plan_unpad as plan_unpad
from .layout import position_ids as position_ids
from .layout import sp_pad as sp_pad
from .layout import sp_unpad as sp_unpad
from .layout import to_bshd as to_bshd
from .layout import to_thd as to_thd
from .layout import unpack_positions as unpack_positions
from .layout import unpad as unpad
from .forward import make_forward as make_forward
from .layers import layer_owner as layer_owner
from .layers import layer_partition as layer_partition

__all__ = [
    # unpad: [b, s, *] <-> [t, *]
    "UnpadInfo", "plan_unpad", "unpad", "pad", "sp_pad", "sp_unpad",
    # THD (Megatron-Core's PackedSeqParams layout, CP zigzag)
    "ThdInfo", "plan_thd", "to_thd", "from_thd", "position_ids", "default_seq_align",
    # BSHD: real tokens moved left
    "BshdInfo", "plan_bshd", "to_bshd", "from_bshd",
    # through any plan above
    "pack_positions", "unpack_positions", "next_token_labels",
    # pipeline layer placement, the forward
    "layer_partition", "layer_owner", "make_forward",
]

__version__ = "0.1.0"
