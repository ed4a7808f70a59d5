#!/usr/bin/env bash
# Everything packfwd checks on the GPU machine, in one call (device time is scarce):
#   carry a folder of wheels (megatron-core for Python 3.12, verl) as WHEELS, then
#   WHEELS=.whl19 bash tests/gpu/run_gpu_checks.sh   (logs go to $OUT, or ./gpu-logs)
# GPU_TESTS narrows the pytest step (default: all of tests/gpu); STEPS picks the steps (default: the four checks
# below, not the benchmarks), e.g. STEPS="kernels gpu_tests bench_step" (each step's log goes to $OUT/<step>.log).
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
STEPS=${STEPS:-attention_backends gpu_tests cuda_unit logprobs_bench}
want() { case " $STEPS " in *" $1 "*) return 0;; esac; return 1; }
want attention_backends && step attention_backends python3 tests/gpu/check_attention_backends.py
# each test file in its own process: one that breaks process-wide state (a CUDA error, the random generator left in
# capture mode) cannot fail the files after it; GPU_TESTS may also carry pytest options (words starting with -)
per_file() {
  local opts=() files=() rc=0
  for w in ${GPU_TESTS:-tests/gpu}; do case $w in -*) opts+=("$w");; *) files+=("$w");; esac; done
  for f in $(for p in "${files[@]}"; do if [ -d "$p" ]; then ls "$p"/test_*.py; else echo "$p"; fi; done); do
    echo "--- $f"; python3 -m pytest -q -p no:cacheprovider -rfEs "${opts[@]}" "$f" || rc=1
  done
  return $rc
}
want gpu_tests && step gpu_tests per_file
want cuda_unit && step cuda_unit python3 -m pytest -q -p no:cacheprovider tests/test_context_parallel.py tests/test_logits.py tests/gpu/test_logprob_kernel.py tests/test_layers.py tests/test_gather_op.py
# the Triton kernels compiled (the same files CI runs in Triton's interpreter: the Makefile's KERNEL_TESTS)
want kernels && step kernels python3 -m pytest -q -p no:cacheprovider $(grep -o 'tests/gpu/test_[a-z_]*kernel\.py' Makefile | sort -u)
want logprobs_bench && step logprobs_bench python3 benchmarks/bench_logprobs.py --device cuda --out "$OUT/logprobs.json"
want bench_step && step bench_step python3 benchmarks/bench_step.py --out "$OUT/step.json" ${BENCH_STEP_ARGS:-}
want bench_scored && step bench_scored python3 benchmarks/bench_scored.py --out "$OUT/scored.json" ${BENCH_SCORED_ARGS:-}
want bench_rl_step && step bench_rl_step python3 benchmarks/bench_rl_step.py --out "$OUT/rl_step.json" ${BENCH_RL_ARGS:-}
want bench_rl_step_moe && step bench_rl_step_moe python3 benchmarks/bench_rl_step.py --model qwen3_moe --out "$OUT/rl_step_moe.json" ${BENCH_RL_MOE_ARGS:-}
want bench_moe && step bench_moe python3 benchmarks/bench_moe.py --out "$OUT/moe.json" ${BENCH_MOE_ARGS:-}
want bench_invariance && step bench_invariance python3 benchmarks/bench_invariance.py --out "$OUT/invariance.json" ${BENCH_INV_ARGS:-}
want bench_transforms && step bench_transforms python3 benchmarks/bench_transforms.py --out "$OUT/transforms.json" ${BENCH_TR_ARGS:-}
want bench_deltanet && step bench_deltanet python3 benchmarks/bench_deltanet.py --out "$OUT/deltanet.json" ${BENCH_DN_ARGS:-}
want bench_hybrid && step bench_hybrid python3 benchmarks/bench_hybrid.py --out "$OUT/hybrid.json" ${BENCH_HYBRID_ARGS:-}
exit $status
