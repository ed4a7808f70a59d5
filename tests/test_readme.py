"""The README's Python examples run as written (each ```python block, in order, in one namespace)."""

import re
from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_python_blocks_run():
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
    assert blocks, "the README has no python examples"
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, str(README), "exec"), namespace)  # noqa: S102


def test_readme_tp_recipe_runs_as_a_script(tmp_path):
    """The "Coming from verl" tensor-parallel recipe, saved as a file and run as a user would: two ranks."""
    import subprocess
    import sys

    (block,) = [b for b in re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)
                if b.startswith("# tp_recipe.py")]
    script = tmp_path / "tp_recipe.py"
    script.write_text(block)
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tensor(" in done.stdout
