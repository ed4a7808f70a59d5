"""The package's shape, as the README's architecture section states it, checked on the source.

* imports flow one way: every package sits on a floor of :data:`FLOORS` and imports only its own modules and
  packages on lower floors, lazily or not (an import inside a function counts); a new package must be given a floor;
* no import circle among modules, lazy imports included (a submodule's import of its own package's face is how
  Python resolves names, not a dependency, and is left out, as ``../shared/tools/import_cycles.py`` does);
* ``viz`` (presentation) and ``verl`` (the drop-in) use public names only: no ``packfwd._*`` module, no private
  name of another packfwd package;
* every module stays under 300 lines, or says at its top why it does not (the words "300 lines");
* the THD rules live in ``layout/rules.py`` alone: no other module re-derives the zigzag owner (``2 * cp - 1 -``).
"""

from __future__ import annotations

import ast
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


@pytest.mark.parametrize("path", [p for p in MODULES if _package(p) in ("viz", "verl")],
                         ids=lambda p: str(p.relative_to(ROOT)))
def test_presentation_and_drop_in_use_public_names(path):
    own = _package(path)
    for name in _imports(path):
        parts = name.split(".")
        if len(parts) > 1 and parts[1] == own:
            continue  # its own modules
        assert not any(p.startswith("_") for p in parts[1:]), f"{path.relative_to(ROOT)} imports private {name}"


@pytest.mark.parametrize("path", MODULES, ids=lambda p: str(p.relative_to(ROOT)))
def test_modules_are_short_or_say_why(path):
    text = path.read_text()
    lines = text.count("\n")
    head = text[: text.find('"""', 3) + 3] if text.startswith('"""') else ""
    assert lines <= 300 or "300 lines" in head, f"{path.relative_to(ROOT)} has {lines} lines and no reason at its top"


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "rules.py"], ids=lambda p: str(p.relative_to(ROOT)))
def test_the_zigzag_is_defined_once(path):
    code = "\n".join(line for line in path.read_text().splitlines() if not line.lstrip().startswith(("#", ">>>")))
    assert "2 * cp - 1 -" not in code and "2 * cp_size - 1 -" not in code.replace("2*cp", "2 * cp"), (
        f"{path.relative_to(ROOT)} re-derives the zigzag owner; call packfwd.layout.rules"
    )
