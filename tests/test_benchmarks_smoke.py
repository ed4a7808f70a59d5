"""The benchmarks keep working: each runs its smoke variant (tiny sizes, CPU) in a subprocess, exits 0 (which
also means its implementations agreed) and writes its JSON.  No timing is asserted."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from run_all import BENCHMARKS  # noqa: E402

PRESENT = [name for name, (script, _) in BENCHMARKS.items() if (ROOT / "benchmarks" / script).exists()]


@pytest.mark.parametrize("name", PRESENT)
def test_smoke_run_exits_zero_and_writes_json(name, tmp_path):
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "run_all.py"), "--smoke", "--only", name, "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    written = list(tmp_path.glob("*.json"))
    assert written, f"{name} wrote no JSON: {proc.stdout[-2000:]}"
    for path in written:
        assert json.loads(path.read_text()), f"{path.name} is empty"
    if name == "transforms":  # the same run's record, read here rather than run a second time
        transforms_records_every_transform(json.loads((tmp_path / "transforms_smoke.json").read_text()))


def transforms_records_every_transform(result: dict):
    names = {r["transform"] for r in result["transforms"]}
    assert names == {"unpad", "pad", "to_thd cp1", "from_thd cp1", "to_thd cp2 r0", "from_thd cp2"}
    assert all(r["equal"] and r["GB/s"] > 0 for r in result["transforms"])
    # against a copy of the same bytes: every transform, each pass's ratio, median within [min, max]
    assert {r["transform"] for r in result["vs_copy"]} == names
    assert all(len(r["ratios"]) == 2 and 0 < r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
               for r in result["vs_copy"])
    assert {"torch", "device", "megatron-core"} <= set(result["env"])
