# Every target sets itself up.  `make test` builds two environments in the repository, each once (a stamp file
# records it), and tests in both:
#
#   .venv-3.12  Python 3.12, torch 2.13.0, megatron-core 0.19.2 (the version every GPU number in RESULTS ran on),
#               the newest transformers: ruff, the whole suite, the kernels in Triton's interpreter, the notebooks.
#   .venv       Python 3.11, torch 2.13.0, megatron-core 0.16.1, transformers 5.17.0 (pyproject's floors; the newest
#               megatron-core for 3.11): FLOOR_TESTS, the tests of the APIs those versions change.  `make demo` and the benchmarks use it.
#
# torch: the CPU build where one can be had.  pip is asked for $(TORCH) with $(CPU_INDEX) as an extra index when
# that index answers (a stock machine), and the CPU build there wins (2.13.0+cpu sorts above 2.13.0).  Where it does
# not answer (this project's machines and CI reach package registries only), pip takes a wheel lying on the machine
# (here: the CPU build for Python 3.11) or else PyPI's, which for Linux is the CUDA build: for Python 3.12 here,
# 527 MB plus 4.2 GB of nvidia-* libraries, about a minute; it runs on the CPU all the same.  The install prints
# which build it got.  Other versions: make test TORCH=torch==2.11.0 MCORE=megatron-core==0.18.0.
PY      := .venv-3.12/bin/python
FLOOR   := .venv/bin/python
TORCH   ?= torch==2.13.0
MCORE   ?= megatron-core==0.19.2
MCORE_FLOOR        ?= megatron-core==0.16.1
TRANSFORMERS_FLOOR ?= transformers==5.17.0
CPU_INDEX ?= https://download.pytorch.org/whl/cpu
# pytest-xdist: two workers (CI has 2 cores), a test file's tests on one worker (module fixtures are built once).
# Only for the suite: the kernel tests and the notebooks took longer with workers than without (each worker's start).
XDIST   ?= -n 2 --dist loadfile
# pip compiles every installed file to .pyc (about 15 s for torch, transformers and megatron-core): keep it, since
# with PYTHONDONTWRITEBYTECODE set (as on this project's machines) Python would otherwise compile each module anew
# in every process, and the suite starts hundreds (ranks, scripts): --no-compile made `make test` twice as slow.
# --no-cache-dir: no second copy of the downloads (for Python 3.12 the CUDA build's 4.7 GB) kept in ~/.cache/pip; a
# CI run once stopped on a full disk while installing
PIP     = -m pip install -q --no-cache-dir

# The first interpreter of version $(1) that runs: python$(1) on PATH, then pyenv's.
find_python = $(firstword $(foreach p,python$(1) $(wildcard $(HOME)/.pyenv/versions/$(1).*/bin/python3),\
	$(shell $(p) -c 'import sys; sys.exit(sys.version_info[:2] != ($(subst .,$(comma),$(1))))' 2>/dev/null && echo $(p))))
comma := ,
PYTHON312 ?= $(call find_python,3.12)
PYTHON311 ?= $(call find_python,3.11)

.PHONY: demo lint test test-main test-floor test-thorough bench bench-smoke clean

# $(call install,VENV,PYTHON,VERSION,PACKAGES): the venv with torch, packfwd[test] and PACKAGES, verl and mbridge.
define install
	@test -n "$(2)" || { echo "no Python $(3) found: install it (pyenv install $(3)) or name it: make PYTHON$(subst .,,$(3))=/path/to/python$(3)"; exit 1; }
	test -x $(1)/bin/python || $(2) -m venv $(1)
	$(1)/bin/python $(PIP) --upgrade pip
	if $(1)/bin/python -c "import urllib.request as u; u.urlopen('$(CPU_INDEX)/torch/', timeout=10)" 2>/dev/null; \
	then $(1)/bin/python $(PIP) --extra-index-url $(CPU_INDEX) "$(TORCH)"; \
	else echo "$(CPU_INDEX) does not answer: $(TORCH) from this machine's wheels or PyPI"; \
	     $(1)/bin/python $(PIP) "$(TORCH)"; fi
	$(1)/bin/python -c "import torch; print('torch', torch.__version__, 'CUDA build (run on the CPU)' if torch.version.cuda else 'CPU build')"
	$(1)/bin/python $(PIP) -e ".[test]" $(4)
	# verl's own packing functions: a reference for tests and benchmarks only (it needs just torch + megatron-core)
	# mbridge (verl's HF <-> Megatron-Core bridge): tests/test_bridge.py checks packfwd's weight mapping against it
	# (pure Python; it needs only megatron-core, transformers, safetensors and einops, which it imports)
	$(1)/bin/python $(PIP) --no-deps "verl==0.9.1" "mbridge==0.15.1" "einops>=0.6"
	$(1)/bin/python -c "import sys; from importlib.metadata import version as v; print('python', sys.version.split()[0], *(f'{p} {v(p)}' for p in ('torch', 'megatron-core', 'transformers')))"
	touch $(1)/.packfwd-installed
endef

.venv-3.12/.packfwd-installed: pyproject.toml Makefile
	$(call install,.venv-3.12,$(PYTHON312),3.12,"$(MCORE)")

.venv/.packfwd-installed: pyproject.toml Makefile
	$(call install,.venv,$(PYTHON311),3.11,"$(MCORE_FLOOR)" "$(TRANSFORMERS_FLOOR)")

demo: .venv/.packfwd-installed
	$(FLOOR) -m packfwd.viz.demo

# The Triton kernels' tests run on the CPU in Triton's interpreter, which must be on before the kernels are
# defined (at import): a pytest process of its own (on a GPU machine the same files run the compiled kernels).
KERNEL_TESTS := tests/gpu/test_gather_kernel.py tests/gpu/test_plan_kernel.py tests/gpu/test_logprob_kernel.py \
                tests/gpu/test_linear_logprob_kernel.py tests/gpu/test_rmsnorm_kernel.py tests/gpu/test_swiglu_kernel.py \
                tests/gpu/test_rope_kernel.py tests/gpu/test_slot_sum_kernel.py \
                tests/gpu/test_zero_groups_kernel.py

# The floor run: the tests that exercise the Megatron-Core and transformers APIs whose versions it pins (model
# building and conversion for every family, MoE routing and EP, MTP, the verl drop-in and mbridge, the parallel
# state with TP/CP/SP/PP/EP over gloo), about 70 s; the whole suite runs on the main environment.  A fuller floor
# run: make test-floor FLOOR_TESTS=tests
FLOOR_TESTS ?= tests/test_models.py tests/test_families.py tests/test_hf_interop.py tests/test_moe.py \
               tests/test_mtp.py tests/test_verl_mtp.py tests/test_verl_dropin.py tests/test_moe_ep.py \
               tests/test_parallel_families.py tests/test_context_parallel.py tests/test_deepseek_v3.py \
               tests/test_glm4_moe.py tests/test_distributed.py tests/test_bridge.py tests/test_hybrid_families.py \
               tests/test_gpt_oss.py

# The multi-process tests' ranks fork from a server that imported these once (packfwd.testing.run_local): each rank
# then starts in a fraction of a second instead of importing Megatron-Core and transformers anew.
test test-main test-floor test-thorough: export PACKFWD_RUN_LOCAL_PRELOAD = torch,megatron.core,transformers

test: lint test-main test-floor

# ruff: the rule set in pyproject.toml (errors, not style)
lint: .venv-3.12/.packfwd-installed
	$(PY) -m ruff check .

test-main: .venv-3.12/.packfwd-installed
	$(PY) -m pytest -q $(XDIST) tests packfwd
	TRITON_INTERPRET=1 $(PY) -m pytest -q $(KERNEL_TESTS)
	@if ls notebooks/*.ipynb >/dev/null 2>&1; then $(PY) -m pytest -q --nbmake notebooks; fi

test-floor: .venv/.packfwd-installed
	$(FLOOR) -m pytest -q $(XDIST) $(FLOOR_TESTS)

# The thorough Hypothesis profile: many more examples per property (minutes, not seconds).
test-thorough: .venv-3.12/.packfwd-installed
	HYPOTHESIS_PROFILE=thorough $(PY) -m pytest -q $(XDIST) tests
	HYPOTHESIS_PROFILE=thorough TRITON_INTERPRET=1 $(PY) -m pytest -q $(KERNEL_TESTS)

bench: .venv/.packfwd-installed
	$(FLOOR) benchmarks/run_all.py

bench-smoke: .venv/.packfwd-installed
	$(FLOOR) benchmarks/run_all.py --smoke

clean:
	rm -rf .venv .venv-3.12 .hypothesis .pytest_cache

# `make notebooks`: JupyterLab on notebooks/ (the [notebook] extra: jupyterlab, ipywidgets, matplotlib), in the
# environment `make test` runs them in
.PHONY: notebooks
notebooks: .venv-3.12/.packfwd-installed
	$(PY) $(PIP) -e ".[notebook]"
	$(PY) -m jupyter lab notebooks
