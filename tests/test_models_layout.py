"""The inner layout of ``packfwd.models``, checked on the source (as ``test_architecture`` checks the packages'):

* its sub-packages and modules sit on floors (:data:`FLOORS`: the vocabulary, the layer components, the families,
  the model's arguments, the Megatron-Core runtime, the HF conversion) and import only their own floor's or lower
  ones, lazily or not;
* a family is one module of ``models/families`` holding its ``FAMILY`` entry, and ``FAMILIES`` is exactly those;
* a token mixer is a component: outside ``models/mixers`` (its home) and ``models/families`` (DeepSeek-V3 reads its
  description) no module branches on multi-head latent attention (``args.mla``); they ask the component.
"""

from __future__ import annotations

import importlib
import re

import pytest

from .test_architecture import MODULES, ROOT, _imports

MODELS = ROOT / "models"

# Bottom to top; a unit is a sub-package or a top-level module of packfwd.models ("__init__": the face).
FLOORS = [
    {"mapping", "norm"},  # the weight-mapping vocabulary, the norms
    {"component"},  # what a layer component is
    {"mixers", "mlp"},  # the layer components: token mixers, MLPs
    {"families"},  # one module per family
    {"args"},  # ModelArgs: asks the components to check their fields
    {"runtime"},  # the Megatron-Core model, its builder, config and specs
    {"convert"},  # HF transformers <-> packfwd
    {"__init__"},
]
FLOOR = {name: i for i, floor in enumerate(FLOORS) for name in floor}
IN_MODELS = [p for p in MODULES if p.is_relative_to(MODELS)]


def _unit(path) -> str:
    rel = path.relative_to(MODELS)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _target(name: str) -> str | None:
    parts = name.split(".")
    if parts[:2] != ["packfwd", "models"]:
        return None
    return parts[2] if len(parts) > 3 or (len(parts) == 3 and parts[2] in FLOOR) else "__init__"


def test_every_unit_has_a_floor():
    units = {_unit(p) for p in IN_MODELS}
    assert units <= set(FLOOR), f"give these parts of packfwd.models a floor: {sorted(units - set(FLOOR))}"


@pytest.mark.parametrize("path", IN_MODELS, ids=lambda p: str(p.relative_to(MODELS)))
def test_imports_flow_down_inside_models(path):
    own = _unit(path)
    for name in _imports(path):
        target = _target(name)
        if target is None or target == own:
            continue
        assert FLOOR[target] < FLOOR[own], (
            f"models/{path.relative_to(MODELS)} ({own}, floor {FLOOR[own]}) imports {name} ({target}, floor "
            f"{FLOOR[target]})")


def test_a_family_is_one_module():
    from packfwd.models.families import FAMILIES

    modules = sorted(p.stem for p in (MODELS / "families").glob("*.py") if p.stem not in ("__init__", "entry"))
    entries = {importlib.import_module(f"packfwd.models.families.{m}").FAMILY.name: m for m in modules}
    assert sorted(entries) == sorted(FAMILIES) and all(entries[n] == n for n in FAMILIES)


@pytest.mark.parametrize("path", [p for p in IN_MODELS if _unit(p) not in ("mixers", "families")],
                         ids=lambda p: str(p.relative_to(MODELS)))
def test_latent_attention_is_asked_not_branched_on(path):
    code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", ">>>")))
    assert not re.search(r"\bmla is (not )?None|if [^\n]*\.mla\b|mla_tp_widths|mla_config_fields", code), (
        f"models/{path.relative_to(MODELS)} branches on multi-head latent attention; ask the token mixer "
        "(packfwd.models.mixers.mixer) instead")
