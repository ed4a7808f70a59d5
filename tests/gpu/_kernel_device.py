"""Where the Triton kernel tests (``test_gather_kernel.py``, ``test_plan_kernel.py``, ``test_logprob_kernel.py``)
run: on a CUDA GPU, compiled, or on the CPU in Triton's interpreter.

The interpreter (``TRITON_INTERPRET=1``) runs every program of a kernel in Python, with numpy, on CPU tensors.
Triton reads the variable when a kernel is defined (``@triton.jit``, at import), so the interpreter needs a
pytest process of its own with the variable set from the start; ``make test`` runs one:

    TRITON_INTERPRET=1 python -m pytest -q tests/gpu/test_gather_kernel.py tests/gpu/test_plan_kernel.py \\
        tests/gpu/test_logprob_kernel.py

Without the variable and without a GPU these tests skip.  The layouts launch the kernels only for CUDA tensors
(``ops.gather.use_op``, ``ops.plan.available``, ``logits._use_kernel``), so on the CPU the tests call the
launchers directly or route the layouts to them with ``monkeypatch`` (see each file).
"""

import os
from importlib.metadata import PackageNotFoundError, version

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _release(package: str) -> tuple[int, int]:
    try:
        return tuple(int(part) for part in version(package).split(".")[:2])
    except (PackageNotFoundError, ValueError):
        return (0, 0)


# Triton's interpreter before 3.7 reads loop bounds with int() of 1-element numpy arrays, which numpy 2.4 turned
# into an error (triton-lang/triton#9171): every kernel with a loop fails there.
OLD_INTERPRETER = INTERPRET and _release("triton") < (3, 7) and _release("numpy") >= (2, 4)

# The interpreter reads host memory: CPU tensors (a CUDA tensor would be copied to the host per argument, and the
# gather kernel reads its other sources through their address offsets from the first).
DEVICE = "cpu" if INTERPRET else "cuda"

if not INTERPRET and not torch.cuda.is_available():
    _skip = ("needs a CUDA GPU, or TRITON_INTERPRET=1 to run the kernels on the CPU in Triton's interpreter "
             "(make test does)")
elif OLD_INTERPRETER:
    _skip = "Triton's interpreter needs triton>=3.7 with numpy>=2.4"
else:
    _skip = ""
needs_kernels = pytest.mark.skipif(bool(_skip), reason=_skip)

# Parts of a test worth running only on the GPU (sizes and checks the interpreter would spend minutes on).
gpu_only = pytest.mark.skipif(DEVICE != "cuda", reason="GPU only (too slow, or meaningless, in the interpreter)")
