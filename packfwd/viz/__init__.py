"""Presentation: pictures of packfwd's layouts as text (``text``) and with matplotlib (``plot``, ``cp``, ``micro``,
``moe``, ``vision``), the command line (``cli``, ``python -m packfwd``) and ``make demo`` (``demo``).

Every picture takes what the user holds (``inputs``): a ``[b, s]`` attention mask, sequence lengths, a plan
(``UnpadInfo``, ``ThdInfo``, ``BshdInfo``, or the list of every CP rank's ``ThdInfo``), a ``MicroBatchPlan``, the
``RoutingStats`` a forward records.  A plan brings its own ``tp_size``/``cp_size``/``seq_align``.  Re-exported here:

* text: ``describe_thd`` (who holds which token, per CP rank), ``describe_layers`` (pipeline stages),
  ``padding_sweep`` (THD tokens with packfwd's and verl's alignment over parallel sizes), ``attention_work`` (each
  CP rank's causal attention work, zigzag against contiguous), ``lengths_mask``
* matplotlib: ``draw_mask``, ``draw_thd`` (each CP rank's tokens), ``draw_zigzag`` (every sequence's ``2 cp``
  chunks coloured by owning rank), ``plot_attention_work``, ``draw_cp_layout`` (the three together),
  ``draw_micro_batches`` (ranks x micro-batches against ``max_tokens``), ``draw_expert_load`` (MoE layers x
  experts), ``draw_routing_agreement`` (two routing records per MoE layer, ``routing_agreement`` its numbers),
  ``draw_layer_partition``, ``plot_padding_sweep``, ``draw_mrope_positions``, ``draw_mrope_cp_split``
  (with ``vision_items``: the image or video of each token)

Large inputs draw as images (a 64 x 1024 mask in a fraction of a second; ``style``).  The plans themselves print
as a few lines and show a table and picture in a notebook (``packfwd.layout.display``).  The building blocks
(``text.token_codes``, ``text.thd_plans``, ``text.padding_overhead``, ...) stay in their modules.  Nothing here is
needed by the transforms, and everything here uses packfwd's public API only.  matplotlib is imported only when a
``draw_*``/``plot_*`` function runs.
"""

from .cp import draw_cp_layout as draw_cp_layout
from .cp import draw_zigzag as draw_zigzag
from .cp import plot_attention_work as plot_attention_work
from .micro import draw_micro_batches as draw_micro_batches
from .moe import draw_expert_load as draw_expert_load
from .moe import draw_routing_agreement as draw_routing_agreement
from .moe import routing_agreement as routing_agreement
from .plot import draw_layer_partition as draw_layer_partition
from .plot import draw_mask as draw_mask
from .plot import draw_thd as draw_thd
from .plot import plot_padding_sweep as plot_padding_sweep
from .text import attention_work as attention_work
from .text import describe_layers as describe_layers
from .text import describe_thd as describe_thd
from .text import lengths_mask as lengths_mask
from .text import padding_sweep as padding_sweep
from .vision import draw_mrope_cp_split as draw_mrope_cp_split
from .vision import draw_mrope_positions as draw_mrope_positions
from .vision import vision_items as vision_items

__all__ = [
    "describe_thd", "describe_layers", "padding_sweep", "attention_work", "lengths_mask",
    "draw_mask", "draw_thd", "draw_zigzag", "plot_attention_work", "draw_cp_layout", "draw_micro_batches",
    "draw_expert_load", "draw_routing_agreement", "routing_agreement", "draw_layer_partition", "plot_padding_sweep",
    "draw_mrope_positions", "draw_mrope_cp_split", "vision_items",
]
