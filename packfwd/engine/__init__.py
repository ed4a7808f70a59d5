"""The one forward engine (:mod:`packfwd.engine.core`): plan, pack every per-token input, call the model, heads and
extensions, unpack.  ``make_forward``, the multi-token-prediction and vision forwards, the model's own padded-rows
call and both verl forwards are argument translation around :class:`Engine`.

Also here: the layout adapters it packs with (:mod:`~packfwd.engine.adapters`), what it reads of a model
(:mod:`~packfwd.engine.facts`) and its eager checks (:mod:`~packfwd.engine.checks`).

Public: ``Engine`` and what it passes around (``Batch``, ``Step``, ``Result``), the ``Extension`` protocol; the
adapters ``Thd`` and ``Bshd``; ``model_facts`` / ``ModelFacts``, ``is_value_model``, ``is_moe``, ``empty_output``;
``text_call`` (the model keywords of a text batch) and ``router_padding`` (the model's ``padding_mask``: the
layout's pads, kept from an MoE model's routers); ``seq_major`` (the layout's token order to the model's ``[s, b]``
row order and back).  Imports no Megatron-Core and
no ``packfwd.models``: the models' padded-rows call runs on it.
"""

from .adapters import Bshd as Bshd
from .adapters import Thd as Thd
from .core import Batch as Batch
from .core import Engine as Engine
from .core import Extension as Extension
from .core import Result as Result
from .core import Step as Step
from .core import router_padding as router_padding
from .core import seq_major as seq_major
from .core import text_call as text_call
from .facts import ModelFacts as ModelFacts
from .facts import empty_output as empty_output
from .facts import is_moe as is_moe
from .facts import is_value_model as is_value_model
from .facts import model_facts as model_facts

__all__ = ["Batch", "Bshd", "Engine", "Extension", "ModelFacts", "Result", "Step", "Thd", "empty_output", "is_moe",
           "is_value_model", "model_facts", "router_padding", "seq_major", "text_call"]
