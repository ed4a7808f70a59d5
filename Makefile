# Every target sets itself up: a .venv in the repo, CPU torch first (a plain `torch` request could
# pull a multi-GB CUDA build), then packfwd in editable mode with its test extra.
VENV   := .venv
PY     := $(VENV)/bin/python
TORCH  ?= torch==2.13.0
STAMP  := $(VENV)/.packfwd-installed

.PHONY: demo test test-thorough bench bench-smoke clean

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[test]"
	# verl's own packing functions: a reference for tests and benchmarks only (it needs just torch + megatron-core)
	$(PY) -m pip install -q --no-deps "verl==0.9.1"
	# mbridge (verl's HF <-> Megatron-Core bridge): tests/test_bridge.py checks packfwd's weight mapping against it
	# (pure Python; it needs only megatron-core, transformers, safetensors and einops, which it imports)
	$(PY) -m pip install -q --no-deps "mbridge==0.15.1" "einops>=0.6"
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m packfwd.viz.demo

# The Triton kernels' tests run on the CPU in Triton's interpreter, which must be on before the kernels are
# defined (at import): a pytest process of its own (on a GPU machine the same files run the compiled kernels).
KERNEL_TESTS := tests/gpu/test_gather_kernel.py tests/gpu/test_plan_kernel.py tests/gpu/test_logprob_kernel.py \
                tests/gpu/test_linear_logprob_kernel.py tests/gpu/test_rmsnorm_kernel.py tests/gpu/test_swiglu_kernel.py \
                tests/gpu/test_rope_kernel.py tests/gpu/test_slot_sum_kernel.py \
                tests/gpu/test_zero_groups_kernel.py

# The multi-process tests' ranks fork from a server that imported these once (packfwd.testing.run_local): each rank
# then starts in a fraction of a second instead of importing Megatron-Core and transformers anew.
test test-thorough: export PACKFWD_RUN_LOCAL_PRELOAD = torch,megatron.core,transformers

test: $(STAMP)
	$(PY) -m pytest -q tests packfwd
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(KERNEL_TESTS)
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then $(PY) -m pytest -q --nbmake notebooks; fi

# The thorough Hypothesis profile: many more examples per property (minutes, not seconds).
test-thorough: $(STAMP)
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q tests
	HYPOTHESIS_PROFILE=thorough TRITON_INTERPRET=1 $(PY) -m pytest -q $(KERNEL_TESTS)

bench: $(STAMP)
	$(PY) benchmarks/run_all.py

bench-smoke: $(STAMP)
	$(PY) benchmarks/run_all.py --smoke

clean:
	rm -rf $(VENV) .hypothesis .pytest_cache
