"""Load verl's own THD packing functions (verl/models/mcore/util.py) without the rest of verl.

verl is installed with ``--no-deps`` (the Makefile does it): the module needs only torch and megatron-core, but
verl's package ``__init__`` imports ray and more, so the file is loaded on its own with two tiny stand-ins for
the verl helpers it imports.  Its parallel sizes come from Megatron's ``parallel_state`` globals; ``patched_mpu``
sets them for one call, with the all-gather of CP outputs done by the caller.
"""

from __future__ import annotations

import contextlib
import importlib.util
import sys
import types


def load_verl_util():
    """Return verl's ``verl.models.mcore.util`` module object, or None when verl is not installed."""
    spec = importlib.util.find_spec("verl")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = spec.submodule_search_locations[0]
    stubs = {
        "verl.utils.device": types.SimpleNamespace(is_npu_available=False),
        "verl.utils.model": types.SimpleNamespace(CausalLMOutputForPPO=object),
    }
    return load_with_stubs(f"{root}/models/mcore/util.py", "packfwd_ref_verl_util", stubs)


def load_with_stubs(path: str, name: str, stubs: dict, keep: str | None = None):
    """Execute the verl source file ``path`` as module ``name`` with ``stubs`` standing in for the modules it
    imports (verl's heavy dependencies are not installed); the stubs are removed afterwards, except those whose
    name starts with ``keep``."""
    saved = {k: sys.modules.get(k) for k in stubs if keep is None or not k.startswith(keep)}
    sys.modules.update(stubs)  # type: ignore[arg-type]
    try:
        mspec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(mspec)
        mspec.loader.exec_module(module)
    finally:
        for k, v in saved.items():
            if v is None:
                sys.modules.pop(k, None)
            else:
                sys.modules[k] = v
    return module


@contextlib.contextmanager
def patched_mpu(module, tp: int, cp: int, cp_rank: int):
    """Make verl's calls to ``mpu.get_*`` see the given sizes (no process groups needed for preprocessing)."""
    mpu = module.mpu
    names = {
        "get_tensor_model_parallel_world_size": lambda: tp,
        "get_context_parallel_world_size": lambda: cp,
        "get_context_parallel_rank": lambda: cp_rank,
    }
    old = {k: getattr(mpu, k) for k in names}
    for k, v in names.items():
        setattr(mpu, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(mpu, k, v)
