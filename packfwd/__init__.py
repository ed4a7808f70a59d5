"""packfwd: pure packing transforms and Megatron-Core forwards for variable-length batches.

Shapes: ``b`` batch, ``s`` padded length, ``t`` packed tokens, ``h`` heads, ``d`` head dim, ``v`` vocab.
"""

from .bshd import BshdInfo as BshdInfo
from .bshd import from_bshd as from_bshd
from .bshd import plan_bshd as plan_bshd
from .bshd import to_bshd as to_bshd
from .forward import make_forward as make_forward
from .labels import next_token_labels as next_token_labels
from .layers import LayerOwner as LayerOwner
from .layers import layer_owner as layer_owner
from .layers import layer_partition as layer_partition
from .padding import UnpadInfo as UnpadInfo
from .padding import pad as pad
from .padding import plan_unpad as plan_unpad
from .padding import unpad as unpad
from .sp import sp_pad as sp_pad
from .sp import sp_unpad as sp_unpad
from .thd import ThdInfo as ThdInfo
from .thd import default_seq_align as default_seq_align
from .thd import from_thd as from_thd
from .thd import plan_thd as plan_thd
from .thd import position_ids as position_ids
from .thd import to_thd as to_thd

__version__ = "0.1.0"
