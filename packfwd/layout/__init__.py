"""Packing layouts, one module each, all planned by one driver (``source``) and applied by one gather (``ops``).

* ``unpad``  padded ``[b, s, *]`` + mask  <->  packed real tokens ``[t, *]``
* ``thd``    Megatron-Core's THD layout (``PackedSeqParams``), per-sequence alignment and the CP zigzag split
* ``bshd``   each row's real tokens moved left into a narrower ``[b, width, *]``
* ``sp``     the token dimension padded to a multiple of the tensor-parallel size
* ``bucket`` THD plans of fixed shape (CUDA graphs)
* ``labels`` next-token (and multi-token prediction) labels that stay right under any packing
* ``positions`` RoPE positions (``[b, s]``, multimodal ``[k, b, s]`` / ``[b, s, k]``) through any plan above
* ``rules``  the alignment rule and the zigzag split, defined once for every module above and below
"""

from .bshd import BshdInfo as BshdInfo
from .bshd import from_bshd as from_bshd
from .bshd import plan_bshd as plan_bshd
from .bshd import to_bshd as to_bshd
from .labels import next_token_labels as next_token_labels
from .labels import mtp_labels as mtp_labels
from .labels import mtp_loss_mask as mtp_loss_mask
from .labels import shift_in_sequence as shift_in_sequence
from .positions import pack_positions as pack_positions
from .positions import unpack_positions as unpack_positions
from .rules import default_seq_align as default_seq_align
from .rules import local_positions as local_positions
from .rules import padded_lengths as padded_lengths
from .rules import zigzag_owner as zigzag_owner
from .rules import zigzag_position as zigzag_position
from .sp import sp_pad as sp_pad
from .sp import sp_unpad as sp_unpad
from .thd import ThdInfo as ThdInfo
from .thd import from_thd as from_thd
from .thd import plan_thd as plan_thd
from .thd import position_ids as position_ids
from .thd import to_thd as to_thd
from .unpad import UnpadInfo as UnpadInfo
from .unpad import pad as pad
from .unpad import plan_unpad as plan_unpad
from .unpad import unpad as unpad
