#!/usr/bin/env bash
# Everything packfwd checks on the GPU machine, in one call (device time is scarce):
#   carry a folder of wheels (megatron-core for Python 3.12, verl) as WHEELS, then
#   WHEELS=.whl19 bash tests/gpu/run_gpu_checks.sh   (logs go to $OUT, or ./gpu-logs)
# GPU_TESTS narrows the pytest step (default: all of tests/gpu).
set -u
OUT=${OUT:-gpu-logs}; mkdir -p "$OUT"
WHEELS=${WHEELS:-.whl}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$WHEELS"/*.whl || exit 1
export PYTHONPATH=.:/tmp/site
python3 - <<'PY' | tee "$OUT/versions.txt"
import torch, megatron.core, platform
print("python", platform.python_version(), "torch", torch.__version__, "cuda", torch.version.cuda,
      "megatron-core", megatron.core.__version__, "gpus", torch.cuda.device_count(), torch.cuda.get_device_name(0))
PY
status=0
step() { name=$1; shift; echo "=== $name: $*"; ( "$@" ) > "$OUT/$name.log" 2>&1; rc=$?; tail -n 4 "$OUT/$name.log"; echo "=== $name rc=$rc"; [ $rc -eq 0 ] || status=1; }
step attention_backends python3 tests/gpu/check_attention_backends.py
step gpu_tests python3 -m pytest -q -p no:cacheprovider ${GPU_TESTS:-tests/gpu}
step cuda_unit python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel.py tests/test_logits.py tests/gpu/test_logprob_kernel.py tests/test_layers.py tests/test_gather_op.py
step logprobs_bench python3 benchmarks/bench_logprobs.py --device cuda --out "$OUT/logprobs.json"
exit $status
