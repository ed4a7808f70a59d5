"""The package's shape, as the README's architecture section states it, checked on the source.

* imports flow one way: ``ops`` imports no other packfwd package; ``layout`` imports only ``ops`` and the shared
  validator; neither imports models, parallel code, the forward or anything above them;
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
    package = ".".join(path.relative_to(ROOT.parent).with_suffix("").parts)
    if path.name != "__init__.py":
        package = package.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("packfwd"))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            if base.startswith("packfwd"):
                found.update(f"{base}.{a.name}" for a in node.names)
    return found


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


ALLOWED = {
    "ops": {"ops"},
    "layout": {"ops", "layout", "_validate"},
}


@pytest.mark.parametrize("path", [p for p in MODULES if _package(p) in ALLOWED], ids=lambda p: str(p.relative_to(ROOT)))
def test_low_layers_import_only_below_them(path):
    allowed = ALLOWED[_package(path)]
    for name in _imports(path):
        parts = name.split(".")
        assert len(parts) < 2 or parts[1] in allowed, f"{path.relative_to(ROOT)} imports {name}"


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
