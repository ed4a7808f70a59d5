"""What is public, said once per package (``__all__``) and kept true.

* every package under ``packfwd/`` (at any depth) has an ``__all__`` of names it defines, and binds no other public name
  (besides its submodules): ``from pkg import *`` gives exactly ``__all__``;
* every public name has its own docstring (not the one a dataclass or NamedTuple makes up);
* every public name is documented where a user looks: ``packfwd``'s in docs/api.md, a subpackage's in its
  package docstring;
* docs/api.md's tables name only what exists: each function in their first column resolves (a bare name to
  ``packfwd.__all__``, or to the module named earlier in the same cell), and every ``from packfwd... import``
  in the README, the notebooks and docs/ resolves;
* every dotted ``packfwd.`` name in a code span of the README and docs/ resolves, every ``packfwd/...`` or
  ``tests/...`` path they name exists, and every relative link (file and ``#anchor``) leads somewhere;
* the README's family table lists exactly the families of ``FAMILIES``.
(The signatures the pages state are checked by ``tests/test_docs_signatures.py``.)
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
API = ROOT / "docs" / "api.md"
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "RESULTS.md"]
# every package found on disk, sub-packages included (packfwd/models/<sub>/ too): a new one is checked unasked
PACKAGES = sorted(
    ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "packfwd").rglob("__init__.py")
)


def _api_section() -> str:
    return API.read_text()


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
    where, text = ("docs/api.md", _api_section()) if name == "packfwd" else ("its docstring", pkg.__doc__)
    undocumented = [n for n in pkg.__all__ if not re.search(rf"(?<![\w.]){n}\b", text)]
    assert not undocumented, f"{name}: {undocumented} are public but not in {where}"


def test_the_api_tables_name_what_exists():
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
                assert hasattr(importlib.import_module(module), attr), f"docs/api.md names {dotted}, which is missing"
            else:
                pkg = importlib.import_module(base)
                assert dotted in getattr(pkg, "__all__", dir(pkg)), f"docs/api.md names {dotted} as public in {base}"
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


def _prose(path: Path) -> str:
    """The page without its fenced blocks (code in them is checked by running it: tests/test_readme.py)."""
    return re.sub(r"^```.*?^```", "", path.read_text(), flags=re.S | re.M)


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            if not hasattr(obj, attr):
                return False
            obj = getattr(obj, attr)
        return True
    return False


def test_dotted_names_and_paths_on_the_pages_exist():
    """A page that names ``packfwd.models.x.y`` or ``packfwd/ops/z.py`` names something that is there."""
    missing = []
    for page in PAGES:
        for span in re.findall(r"`([^`\n]+)`", _prose(page)):
            for dotted in re.findall(r"(?<![\w/.])packfwd(?:\.[A-Za-z_]\w*)+", span):
                if not _resolves(dotted):
                    missing.append(f"{page.name}: {dotted}")
            for path in re.findall(r"(?<![\w/.])((?:packfwd|tests|benchmarks|notebooks|docs)/[\w./-]*\w)", span):
                if not (ROOT / path).exists() and not path.startswith("benchmarks/out"):
                    missing.append(f"{page.name}: {path}")
    assert not missing, "names and paths that do not exist:\n" + "\n".join(missing)


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower().replace("`", ""))
    return text.replace(" ", "-")


def test_relative_links_lead_somewhere():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", _prose(page)):
            if re.match(r"\w+://", target):
                continue
            file, _, anchor = target.partition("#")
            dest = (page.parent / file).resolve() if file else page
            if not dest.exists():
                broken.append(f"{page.name}: {target}")
            elif anchor and dest.suffix == ".md":
                anchors = {_anchor(h) for h in re.findall(r"^#+ (.+)$", _prose(dest), flags=re.M)}
                if anchor not in anchors:
                    broken.append(f"{page.name}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_readme_family_table_is_families():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("\n## Model families\n"):]
    section = section[: section.index("\n## ", 1)]
    where = re.search(r"`(packfwd(?:\.\w+)+)\.FAMILIES`", section)
    assert where, "the README's family section names no FAMILIES"
    families = importlib.import_module(where.group(1)).FAMILIES
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert rows == list(families), f"the README's family table lists {rows}; FAMILIES holds {list(families)}"


def test_code_and_tests_point_at_pages_that_exist():
    """A docstring or comment that sends the reader to ``docs/<page>.md`` (or a notebook cell that does) names a page
    that is there: the pages move, the pointers must follow."""
    stale = []
    for path in [*(ROOT / "packfwd").rglob("*.py"), *(ROOT / "tests").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py"),
                 *(ROOT / "notebooks").glob("*.ipynb"), ROOT / "Makefile", ROOT / "pyproject.toml"]:
        for page in set(re.findall(r"docs/[\w-]+\.md", path.read_text())):
            if not (ROOT / page).exists():
                stale.append(f"{path.relative_to(ROOT)}: {page}")
    assert not stale, "pointers to pages that do not exist:\n" + "\n".join(sorted(stale))


def test_the_results_table_names_files_that_exist():
    """Every row of RESULTS' current-numbers table comes from a file kept under benchmarks/results/."""
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    table = text[text.index("\n## Current numbers\n"): text.index("\n## What the numbers answer\n")]
    legend = dict(re.findall(r"`(\w+)`\s+(?:is\s+)?`benchmarks/results/([\w-]+)/`", table))
    legend.update(re.findall(r"`(\w+)`\s+`([\w-]+)/`", table))
    rows = [r for r in re.findall(r"^\|(.+)\|\s*$", table, flags=re.M) if not set(r) <= {"-", "|", " "}][1:]
    assert len(rows) >= 10
    for row in rows:
        name = row.split("|")[-1].strip().strip("`")
        prefix, _, rest = name.partition("/")
        path = ROOT / "benchmarks" / "results" / (f"{legend[prefix]}/{rest}" if rest else name)
        assert path.exists(), f"RESULTS' table names {name} ({path}), which is not there"
