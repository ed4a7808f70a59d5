"""Packing layouts, one module each, all planned by one driver (``source``) and applied by one gather (``ops``).

* ``unpad``  padded ``[b, s, *]`` + mask  <->  packed real tokens ``[t, *]``: ``plan_unpad``, ``unpad``, ``pad``,
  ``UnpadInfo``
* ``thd``    Megatron-Core's THD layout (``PackedSeqParams``), per-sequence alignment and the CP zigzag split:
  ``plan_thd``, ``to_thd``, ``from_thd``, ``position_ids``, ``ThdInfo``
* ``bshd``   each row's real tokens moved left into a narrower ``[b, width, *]``: ``plan_bshd``, ``to_bshd``,
  ``from_bshd``, ``BshdInfo``
* ``sp``     the token dimension padded to a multiple of the tensor-parallel size: ``sp_pad``, ``sp_unpad``
* ``bucket`` THD plans of fixed shape (CUDA graphs)
* ``labels`` next-token (and multi-token prediction) labels that stay right under any packing:
  ``next_token_labels``, ``mtp_labels``, ``mtp_loss_mask``, ``mtp_targets``, ``shift_in_sequence``
* ``positions`` RoPE positions (``[b, s]``, multimodal ``[k, b, s]`` / ``[b, s, k]``) through any plan above:
  ``pack_positions``, ``unpack_positions``; ``LayoutPlan``, the methods every plan has (``pack_tokens``,
  ``unpack_tokens``, ``token_dims``), so callers never ask which layout a plan is
* ``rules``  the alignment rule and the zigzag split, defined once for every module above and below:
  ``default_seq_align``, ``padded_lengths`` (the zigzag itself: ``rules.zigzag_owner``, ``rules.local_positions``)
"""

from .bshd import BshdInfo as BshdInfo
from .bshd import from_bshd as from_bshd
from .bshd import plan_bshd as plan_bshd
from .bshd import to_bshd as to_bshd
from .labels import mtp_labels as mtp_labels
from .labels import mtp_loss_mask as mtp_loss_mask
from .labels import mtp_targets as mtp_targets
from .labels import next_token_labels as next_token_labels
from .labels import shift_in_sequence as shift_in_sequence
from .positions import LayoutPlan as LayoutPlan
from .positions import pack_positions as pack_positions
from .positions import unpack_positions as unpack_positions
from .rules import default_seq_align as default_seq_align
from .rules import padded_lengths as padded_lengths
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

__all__ = [
    "UnpadInfo", "plan_unpad", "unpad", "pad",
    "ThdInfo", "plan_thd", "to_thd", "from_thd", "position_ids",
    "BshdInfo", "plan_bshd", "to_bshd", "from_bshd",
    "sp_pad", "sp_unpad",
    "next_token_labels", "mtp_labels", "mtp_loss_mask", "mtp_targets", "shift_in_sequence",
    "LayoutPlan", "pack_positions", "unpack_positions",
    "default_seq_align", "padded_lengths",
]
