"""Presentation: pictures of packfwd's layouts as text (``text``) and with matplotlib (``plot``, ``vision``), the
command line (``cli``, ``python -m packfwd``) and ``make demo`` (``demo``).

Re-exported here, the pictures the notebooks draw:

* text: ``describe_thd`` (who holds which token, per CP rank), ``describe_layers`` (pipeline stages),
  ``padding_sweep`` (THD tokens with packfwd's and verl's alignment over parallel sizes), ``lengths_mask``
* matplotlib: ``draw_mask``, ``draw_thd``, ``draw_layer_partition``, ``plot_padding_sweep``,
  ``draw_mrope_positions``, ``draw_mrope_cp_split`` (with ``vision_items``: the image or video of each token)

The building blocks (``text.token_codes``, ``text.thd_plans``, ``text.padding_overhead``, ...) stay in their
modules.  Nothing here is needed by the transforms, and everything here uses packfwd's public API only.
matplotlib is imported only when a ``draw_*``/``plot_*`` function runs.
"""

from .plot import draw_layer_partition as draw_layer_partition
from .plot import draw_mask as draw_mask
from .plot import draw_thd as draw_thd
from .plot import plot_padding_sweep as plot_padding_sweep
from .text import describe_layers as describe_layers
from .text import describe_thd as describe_thd
from .text import lengths_mask as lengths_mask
from .text import padding_sweep as padding_sweep
from .vision import draw_mrope_cp_split as draw_mrope_cp_split
from .vision import draw_mrope_positions as draw_mrope_positions
from .vision import vision_items as vision_items

__all__ = [
    "describe_thd", "describe_layers", "padding_sweep", "lengths_mask",
    "draw_mask", "draw_thd", "draw_layer_partition", "plot_padding_sweep",
    "draw_mrope_positions", "draw_mrope_cp_split", "vision_items",
]
