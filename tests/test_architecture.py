"""The package's shape, as docs/architecture.md states it, checked on the source.

* imports flow one way: every top-level package sits on a floor of :data:`FLOORS` and imports only its own
  modules (its sub-packages included: ``models/mixers/`` is on ``models``' floor) and packages on lower floors,
  lazily or not (an import inside a function counts); a new top-level package must be given a floor;
* no import circle among modules, lazy imports included (a submodule's import of its own package's face is how
  Python resolves names, not a dependency, and is left out, as ``../shared/tools/import_cycles.py`` does);
* ``viz`` (presentation) and ``verl`` (the drop-in) use public names only: every name they import from another
  packfwd module is in that module's ``__all__`` (a module without ``__all__`` offers none: import the name from
  the package that lists it), and a module they import whole is not private;
* the THD rules live in ``layout/rules.py`` alone: no other module re-derives the zigzag owner (``2 * cp - 1 -``).

Module size is not checked: a module is judged by having one purpose, not by a line count.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "packfwd"
MODULES = sorted(p for p in ROOT.rglob("*.py"))


def _imports(path: Path) -> set[str]:
    """Absolute names of the packfwd modules (and names) ``path`` imports, lazily or not."""
    package = ".".join(path.parent.relative_to(ROOT.parent).parts)  # what a relative import starts from
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == "packfwd")
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "packfwd":
                found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


PACKAGES = {_package(p) for p in MODULES}

# Bottom to top.  A package imports its own modules and packages of lower floors only.  "__init__" is the face,
# packfwd/__init__.py (``from packfwd import to_thd`` imports it), "__main__" the ``python -m packfwd`` entry.
FLOORS = [
    {"_validate"},  # argument checks, unwrap
    {"ops"},  # kernels and their launchers
    {"layout"},  # the transforms, the alignment and CP rules
    {"logits", "layers"},  # log-probs and entropy; pipeline layer placement
    {"parallel"},  # CP attention and gather, the pipeline schedule, cross-rank agreement
    {"engine"},  # the one forward engine: plan, pack, call, heads and extensions, unpack; its layout adapters
    {"models"},  # PackedGPTModel, its parts, HF conversion
    {"forward"},  # make_forward
    {"__init__"},  # the package face
    {"vision"},  # vision-language inputs and model
    {"micro"},  # micro-batch planning and the step
    {"verl"},  # verl's forwards with packfwd inside
    {"viz"},  # pictures, demo, CLI
    {"__main__"},
    {"testing"},  # run_local: the tests' and notebooks' launcher; the library never imports it
]
FLOOR = {name: i for i, floor in enumerate(FLOORS) for name in floor}


def _target(name: str) -> str:
    """The package an imported name lives in (a name of the face, ``packfwd.to_thd``, is the face's)."""
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in PACKAGES else "__init__"


def test_every_package_has_a_floor():
    assert PACKAGES <= set(FLOOR), f"give these packages a floor in FLOORS: {sorted(PACKAGES - set(FLOOR))}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_imports_flow_down(path):
    own = _package(path)
    for name in _imports(path):
        target = _target(name)
        assert target == own or FLOOR[target] < FLOOR[own], (
            f"{path.relative_to(ROOT)} (floor {FLOOR[own]}, {own}) imports {name} (floor {FLOOR[target]}, {target})"
        )


def _module_graph() -> dict[str, set[str]]:
    """Module -> the packfwd modules it imports (the longest module prefix of each imported name)."""
    names = {}
    for path in MODULES:
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        names[path] = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
    known = set(names.values())
    graph = {}
    for path, module in names.items():
        edges = set()
        for name in _imports(path):
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):  # not its own package's face
                edges.add(name)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle():
    graph = _module_graph()
    circles = _circles(graph)
    assert not circles, "import circles: " + "; ".join(
        " <-> ".join(c) + " (" + ", ".join(f"{m} -> {sorted(graph[m] & set(c))}" for m in c) + ")" for c in circles)


def test_circle_finder_finds_a_lazy_circle():
    """The circle test is not vacuous: a two-module circle and a three-module one are found."""
    graph = {"a": {"b"}, "b": {"a"}, "c": {"d"}, "d": {"e"}, "e": {"c"}, "f": {"a"}}
    assert sorted(_circles(graph)) == [["a", "b"], ["c", "d", "e"]]


def _imported_names(path: Path, source: str | None = None) -> list[tuple[str, str | None]]:
    """``(module, name)`` for each ``from module import name`` of a packfwd module in ``path`` (or in ``source``
    as if it were there), ``(module, None)`` for each ``import module``; relative imports made absolute."""
    package = ".".join(path.parent.relative_to(ROOT.parent).parts)
    found = []
    for node in ast.walk(ast.parse(path.read_text() if source is None else source)):
        if isinstance(node, ast.Import):
            found += [(a.name, None) for a in node.names if a.name.split(".")[0] == "packfwd"]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.split(".")[0] == "packfwd":
                found += [(base, a.name) for a in node.names]
    return found


def _private_uses(path: Path, source: str | None = None) -> list[str]:
    """What ``path`` imports from another packfwd package that is not public: a name outside the ``__all__`` of
    the module it comes from, or a private module."""
    own = _package(path)
    bad = []
    for module, name in _imported_names(path, source):
        parts = module.split(".")
        if len(parts) > 1 and parts[1] == own:
            continue  # its own modules
        if any(p.startswith("_") for p in parts[1:]):
            bad.append(f"{module} (a private module)")
            continue
        if name is None:
            continue
        if _is_package(module) and importlib.util.find_spec(f"{module}.{name}") is not None:
            if name.startswith("_"):
                bad.append(f"{module}.{name} (a private module)")
            continue  # a public submodule
        public = getattr(importlib.import_module(module), "__all__", None)
        if public is None:
            bad.append(f"{module}.{name} ({module} has no __all__: import it from the package that lists it)")
        elif name not in public:
            bad.append(f"{module}.{name} (not in {module}.__all__)")
    return bad


def _is_package(module: str) -> bool:
    return (ROOT.parent / Path(*module.split(".")) / "__init__.py").exists()


@pytest.mark.parametrize("path", [p for p in MODULES if _package(p) in ("viz", "verl")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_presentation_and_drop_in_use_public_names(path):
    bad = _private_uses(path)
    assert not bad, f"{path.relative_to(ROOT)} imports names that are not public: {bad}"


def test_public_names_check_is_not_vacuous(monkeypatch):
    """A private module, a name outside ``__all__`` and a name of a module without ``__all__`` are each caught;
    a name in ``__all__``, a public submodule and the module's own package pass."""
    import packfwd.layout

    monkeypatch.delattr(packfwd.layout, "__all__")  # packfwd.layout as if it had none
    source = "\n".join([
        "from packfwd import to_thd",  # in packfwd.__all__
        "from packfwd.layout import rules",  # a public submodule
        "from packfwd.viz import text",  # its own package
        "from packfwd._validate import unwrap",  # a private module
        "from packfwd import not_a_public_name",  # outside packfwd.__all__
        "from packfwd.layout import plan_thd",  # a module without __all__
    ])
    bad = _private_uses(ROOT / "viz" / "probe.py", source)
    assert [b.split(" ")[0] for b in bad] == ["packfwd._validate", "packfwd.not_a_public_name",
                                              "packfwd.layout.plan_thd"], bad


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "rules.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_zigzag_is_defined_once(path):
    code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", ">>>")))
    assert "2 * cp - 1 -" not in code and "2 * cp_size - 1 -" not in code.replace("2*cp", "2 * cp"), (
        f"{path.relative_to(ROOT)} re-derives the zigzag owner; call packfwd.layout.rules"
    )
