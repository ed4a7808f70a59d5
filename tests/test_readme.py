"""The Python examples of the README and of every docs/ page run as written.

The convention the pages follow (and this test enforces):

* each ```python block of a page runs, in order, in one namespace per page (a block may use what an earlier block
  of the same page defined, never another page's);
* a block whose first line is ``# name.py: python name.py`` is a script: it is saved as that file and run in a
  fresh interpreter, as a user would (scripts that start processes need their ``if __name__ == "__main__"`` guard);
* a block whose first line is ``# not run: <reason>`` is shown, not run; the reason must be given;
* Python is fenced ```python only: another spelling (```py, ```python3, ...) fails, so no example escapes the test.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_BLOCK = re.compile(r"^```(\S*)[^\n]*\n(.*?)^```", flags=re.S | re.M)
_SCRIPT = re.compile(r"#\s*(\w+\.py): python \1\b")
_NOT_RUN = re.compile(r"#\s*not run:\s*(\S.*)")
_OTHER_PYTHON = {"py", "python3", "py3", "pycon", "ipython", "python-norun"}


def _blocks(page: Path) -> list[tuple[str, str]]:
    """``(kind, code)`` of every python block: kind is "run", "script" or "not run"."""
    out = []
    for lang, code in _BLOCK.findall(page.read_text()):
        assert lang not in _OTHER_PYTHON, f"{page.name}: fence Python as ```python, not ```{lang}"
        if lang != "python":
            continue
        first = code.split("\n", 1)[0]
        if _SCRIPT.match(first):
            out.append(("script", code))
        elif first.lstrip().startswith("# not run"):
            assert _NOT_RUN.match(first), f"{page.name}: a '# not run:' block must say why: {first!r}"
            out.append(("not run", code))
        else:
            out.append(("run", code))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_run(page):
    namespace: dict = {"__name__": f"docs_{page.stem}"}
    for kind, code in _blocks(page):
        if kind == "run":
            exec(compile(code, str(page), "exec"), namespace)  # noqa: S102


SCRIPTS = [(page, code) for page in PAGES for kind, code in _blocks(page) if kind == "script"]


@pytest.mark.parametrize("page, code", SCRIPTS, ids=[_SCRIPT.match(c).group(1) for _, c in SCRIPTS])
def test_script_blocks_run_as_files(page, code, tmp_path):
    """A script block saved as its file and run from a shell, as the page says to."""
    name = _SCRIPT.match(code).group(1)
    (tmp_path / name).write_text(code)
    done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, f"{page.name}: {name} failed:\n{done.stderr[-3000:]}"


def test_the_pages_have_examples_and_say_why_one_is_not_run():
    kinds = [kind for page in PAGES for kind, _ in _blocks(page)]
    assert kinds.count("run") >= 15 and kinds.count("script") >= 2, kinds
    assert any(kind == "run" for kind, _ in _blocks(ROOT / "README.md")), "the README has no example that runs"


def test_the_convention_is_enforced(tmp_path):
    """Negative control: a ```py block and a reasonless '# not run' are refused."""
    bad = tmp_path / "bad.md"
    bad.write_text("```py\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="fence Python as"):
        _blocks(bad)
    bad.write_text("```python\n# not run\nx = 1\n```\n")
    with pytest.raises(AssertionError, match="must say why"):
        _blocks(bad)
