"""Presentation: pictures of packfwd's layouts as text (``text``) and with matplotlib (``plot``), the command
line (``cli``, ``python -m packfwd``) and ``make demo`` (``demo``).

Nothing here is needed by the transforms, and everything here uses packfwd's public API only.  matplotlib is
imported only when a ``draw_*``/``plot_*`` function runs.
"""

from .plot import draw_layer_partition as draw_layer_partition
from .plot import draw_mask as draw_mask
from .plot import draw_thd as draw_thd
from .plot import plot_padding_sweep as plot_padding_sweep
from .text import describe_layers as describe_layers
from .text import describe_padding as describe_padding
from .text import describe_thd as describe_thd
from .text import lengths_mask as lengths_mask
from .text import padding_overhead as padding_overhead
from .text import padding_sweep as padding_sweep
from .text import sequence_name as sequence_name
from .text import thd_plans as thd_plans
from .text import token_codes as token_codes
from .text import token_names as token_names
from .text import verl_seq_align as verl_seq_align
from .vision import draw_mrope_cp_split as draw_mrope_cp_split
from .vision import draw_mrope_positions as draw_mrope_positions
from .vision import vision_items as vision_items
