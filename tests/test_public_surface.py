"""What is public, said once per package (``__all__``) and kept true.

* every package under ``packfwd/`` (at any depth) has an ``__all__`` of names it defines, and binds no other public name
  (besides its submodules): ``from pkg import *`` gives exactly ``__all__``;
* every public name has its own docstring (not the one a dataclass or NamedTuple makes up);
* every public name is documented where a user looks: ``packfwd``'s in the README's "## API" section, a
  subpackage's in its package docstring;
* the README's API table names only what exists: each function in its first column resolves (a bare name to
  ``packfwd.__all__``, or to the module named earlier in the same cell), and every ``from packfwd... import``
  in the README, the notebooks and docs/ resolves.
"""

from __future__ import annotations

import __future__
import importlib
import importlib.util
import json
import re
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# every package found on disk, sub-packages included (packfwd/models/<sub>/ too): a new one is checked unasked
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "packfwd").rglob("__init__.py")
)


def _api_section() -> str:
    text = (ROOT / "README.md").read_text()
    start = text.index("\n## API\n")
    return text[start : text.index("\n## ", start + 1)]


@pytest.mark.parametrize("name", PACKAGES)
def test_every_package_says_what_is_public(name):
    pkg = importlib.import_module(name)
    assert isinstance(getattr(pkg, "__all__", None), list), f"{name} has no __all__ list"
    assert len(set(pkg.__all__)) == len(pkg.__all__), f"{name}.__all__ repeats a name"
    missing = [n for n in pkg.__all__ if not hasattr(pkg, n)]
    assert not missing, f"{name}.__all__ names {missing}, which {name} does not define"
    bound = {
        n for n, v in vars(pkg).items()
        if not n.startswith("_") and not isinstance(v, (types.ModuleType, __future__._Feature))
    }
    assert bound == set(pkg.__all__), f"{name} binds public names outside __all__: {sorted(bound - set(pkg.__all__))}"
    namespace: dict = {}
    exec(f"from {name} import *", namespace)  # noqa: S102
    assert set(namespace) - {"__builtins__"} == set(pkg.__all__)


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_has_a_docstring(name):
    pkg = importlib.import_module(name)
    for n in pkg.__all__:
        doc = getattr(pkg, n).__doc__ or ""
        # a dataclass or NamedTuple without a docstring gets its signature, "Name(field, ...)", as __doc__
        assert doc.strip() and not doc.startswith(f"{n}("), f"{name}.{n} has no docstring"


@pytest.mark.parametrize("name", PACKAGES)
def test_every_public_name_is_documented(name):
    pkg = importlib.import_module(name)
    where, text = ("the README's API section", _api_section()) if name == "packfwd" else ("its docstring", pkg.__doc__)
    undocumented = [n for n in pkg.__all__ if not re.search(rf"(?<![\w.]){n}\b", text)]
    assert not undocumented, f"{name}: {undocumented} are public but not in {where}"


def test_the_readme_api_table_names_what_exists():
    checked = 0
    for row in re.findall(r"^\| (.+?) \|", _api_section(), flags=re.M):
        if set(row) <= {"-", "|"} or row == "function":
            continue
        base = "packfwd"
        for span in re.findall(r"`([^`]+)`", row):
            dotted = re.match(r"[A-Za-z_][\w.]*", span).group(0)
            if dotted.startswith("packfwd."):
                module, attr = dotted.rsplit(".", 1)
                base = module
                assert hasattr(importlib.import_module(module), attr), f"README API names {dotted}, which is missing"
            else:
                pkg = importlib.import_module(base)
                assert dotted in getattr(pkg, "__all__", dir(pkg)), f"README API names {dotted} as public in {base}"
            checked += 1
    assert checked >= 25


def _code_texts():
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        cells = json.loads(path.read_text())["cells"]
        yield path.name, "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        yield path.name, "\n".join(re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S))


def test_imports_in_the_readme_notebooks_and_docs_resolve():
    seen = 0
    for where, code in _code_texts():
        for module, names in re.findall(r"^\s*from (packfwd[\w.]*) import \(?([^)\n]+)", code, flags=re.M):
            mod = importlib.import_module(module)
            for n in re.findall(r"(\w+)(?:\s+as\s+\w+)?", names):
                if n == "as":
                    continue
                ok = hasattr(mod, n) or importlib.util.find_spec(f"{module}.{n}") is not None
                assert ok, f"{where}: from {module} import {n} fails"
                seen += 1
    assert seen >= 10
