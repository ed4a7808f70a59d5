"""packfwd: pure packing transforms and Megatron-Core forwards for variable-length batches.

Shapes: ``b`` batch, ``s`` padded length, ``t`` packed tokens, ``h`` heads, ``d`` head dim, ``v`` vocab.
"""

from .layout import BshdInfo as BshdInfo
from .layout import from_bshd as from_bshd
from .layout import plan_bshd as plan_bshd
from .layout import to_bshd as to_bshd
from .forward import make_forward as make_forward
from .layout import next_token_labels as next_token_labels
from .layout import mtp_labels as mtp_labels
from .layout import mtp_loss_mask as mtp_loss_mask
from .layout import pack_positions as pack_positions
from .layout import unpack_positions as unpack_positions
from .layers import LayerOwner as LayerOwner
from .layers import layer_owner as layer_owner
from .layers import layer_partition as layer_partition
from .layout import UnpadInfo as UnpadInfo
from .layout import pad as pad
from .layout import plan_unpad as plan_unpad
from .layout import unpad as unpad
from .layout import sp_pad as sp_pad
from .layout import sp_unpad as sp_unpad
from .layout import ThdInfo as ThdInfo
from .layout import default_seq_align as default_seq_align
from .layout import from_thd as from_thd
from .layout import plan_thd as plan_thd
from .layout import position_ids as position_ids
from .layout import to_thd as to_thd

__version__ = "0.1.0"
