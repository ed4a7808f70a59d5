"""Load verl's own Megatron forwards (``verl/models/mcore/model_forward.py``) without the rest of verl.

Like :mod:`tests.verl_ref` (whose loader of ``util.py`` this reuses): verl is installed with ``--no-deps`` and
its package ``__init__`` imports ray and more, so ``model_forward.py`` is loaded on its own, as the module
``packfwd_ref_verl_mcore.model_forward`` of a stand-in package whose ``util`` is verl's ``util.py``, with
stand-ins for the two verl names it imports (``unwrap_model``, ``MtpConfig``).  The functions read Megatron's
real ``parallel_state``.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import sys
import types

from .verl_ref import load_verl_util, load_with_stubs

PACKAGE = "packfwd_ref_verl_mcore"


@dataclasses.dataclass
class MtpConfig:
    """The fields of verl's ``MtpConfig`` that its forwards read."""

    enable: bool = False
    enable_train: bool = False


def unwrap_model(model):
    """verl's ``unwrap_model`` for one model: follow ``.module`` through the wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def load_verl_forward():
    """Return verl's ``model_forward`` module object, or None when verl is not installed."""
    if PACKAGE + ".model_forward" in sys.modules:
        return sys.modules[PACKAGE + ".model_forward"]
    spec = importlib.util.find_spec("verl")
    util = load_verl_util()
    if spec is None or util is None:
        return None
    if not hasattr(logging.Logger, "warning_once"):
        # verl's util calls logger.warning_once, a method transformers adds to logging.Logger when imported.
        logging.Logger.warning_once = logging.Logger.warning
    root = spec.submodule_search_locations[0]
    package = types.ModuleType(PACKAGE)
    package.__path__ = []
    stubs = {
        PACKAGE: package,
        PACKAGE + ".util": util,
        "verl.utils.megatron_utils": types.SimpleNamespace(unwrap_model=unwrap_model),
        "verl.workers.config": types.SimpleNamespace(MtpConfig=MtpConfig),
    }
    module = load_with_stubs(f"{root}/models/mcore/model_forward.py", PACKAGE + ".model_forward", stubs, keep=PACKAGE)
    sys.modules[PACKAGE + ".model_forward"] = module
    return module
