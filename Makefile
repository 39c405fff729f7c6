# `make test` and `make quickstart` work on a fresh machine: they create .venv/ if it is missing.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python

.PHONY: test test-fast test-long test-slurm lint mutation quickstart setup clean cuda-check gpu-wheels

setup: $(VENV)/.installed

# The editable install runs without build isolation, so that the fused kernels (csrc/) build against the
# torch installed first; it reruns when their sources change. pip is quiet (pages of output otherwise), so
# each step says what it installs, how long it may take, and how long it took.
$(VENV)/.installed: setup.py requirements/cpu.txt $(wildcard csrc/*.cpp csrc/*.h csrc/cpu/* csrc/cuda/*)
	@echo "Setting up $(VENV)/: torch (CPU build), megatron-core, angpt and the test tools; 3-15 minutes in all"
	$(call timed,[setup 1/3] the virtual environment and the latest pip: under a minute,\
		{ test -x $(PY) || $(PYTHON) -m venv $(VENV); } && $(PY) -m pip install --quiet --upgrade pip)
	$(call timed,[setup 2/3] torch 2.13 (CPU build$(comma) about 200 MB) and megatron-core: 1-5 minutes,\
		$(PY) -m pip install --quiet -r requirements/cpu.txt)
	$(call timed,[setup 3/3] angpt and its dependencies (transformers$(comma) TensorBoard$(comma) pytest$(comma)\
		lm-eval$(comma) matplotlib)$(comma) compiling its C++ kernels: 2-10 minutes,\
		$(PY) -m pip install --quiet --no-build-isolation -e '.[test]')
	@touch $@

comma := ,
# $(call timed,heading,command): the heading, the command, then how long it took (its failure stops make).
define timed
	@echo "$(strip $(1)) ..."
	@start=$$(date +%s) && $(2) && seconds=$$(($$(date +%s) - start)) && \
		printf '    done in %dm %02ds\n' $$((seconds / 60)) $$((seconds % 60))
endef

# Every test but the long checks; the files are spread over one pytest-xdist worker per core (tests/conftest.py
# keeps a file's tests, and files sharing a fixture, on one worker). The 15 slowest are listed at the end: a
# test over a minute on a quiet 2-core machine says in a comment why it cannot be cheaper.
test: setup
	$(PY) -m pytest -q -n auto --dist loadgroup -m "not long" --durations=15

# The long end-to-end checks (minutes each: the convergence benchmark), which CI runs after `make test`.
test-long: setup
	$(PY) -m pytest -q -n auto --dist loadgroup -m long --durations=15

# examples/pretrain.slurm under a real one-node Slurm started here (as root: Debian's slurm-wlm and munge are
# installed first): saved at the time limit's warning, requeued, resumed, ended as an uninterrupted run. Minutes:
# CI runs it after `make test`.
test-slurm: setup
	@command -v slurmctld >/dev/null || { apt-get update -qq && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurm-wlm munge >/dev/null; }
	$(PY) tests/slurm/requeue_check.py

# The in-process tests that take seconds each, for iterating: no torchrun jobs, no compiler, no end-to-end
# scripts (`make test` runs those too).
test-fast: setup
	$(PY) -m pytest -q -n auto --dist loadgroup -m "not multiprocess and not slow and not long"

# ruff, configured in pyproject.toml (tests/test_lint.py runs the same check).
lint: setup
	$(PY) -m ruff check .

# Mutation testing of the guards and the arithmetic (tools/mutation.py, docs/testing.md): each module's mutants
# against its own fast tests, in copies under build/mutation/; minutes per module. MODULES=... selects some.
mutation: setup
	$(PY) tools/mutation.py $(MODULES)

quickstart: setup
	PATH=$(abspath $(VENV))/bin:$$PATH bash examples/quickstart.sh

# The wheels the GPU machine lacks (megatron-core, gigatoken, nltk and what they import), for its Python, at the
# versions installed here, into .whl/, which benchmarks/gpu_checks.sh installs from; fails over 64 MiB. TE=1 adds
# Transformer Engine's bundle and data/shakespeare, for gpu_checks.sh --te.
gpu-wheels: setup
	$(PY) tools/gpu_wheels.py --output .whl $(if $(TE),--te)

# Compiles the CUDA sources with nvcc for each of CUDA_ARCHS (no GPU, no CUDA build of torch needed), with
# the half-precision flags torch's extension builds use, and the CUDA dispatch of the bindings for syntax,
# so that CUDA code that does not compile fails here rather than on a cluster. Outputs (objects, and a stamp
# for the bindings) go under build/, so an unchanged source is not compiled again.
NVCC ?= $(shell command -v nvcc || echo /usr/local/cuda/bin/nvcc)
CUDA_CHECK_DIR := build/cuda-check
CUDA_ARCHS ?= 80 90
CUDA_GENCODE = $(foreach arch,$(CUDA_ARCHS),-gencode arch=compute_$(arch),code=sm_$(arch))
TORCH_CUDA_FLAGS := -D__CUDA_NO_HALF_OPERATORS__ -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ \
	-D__CUDA_NO_HALF2_OPERATORS__
CUDA_ARCH_DIR = $(CUDA_CHECK_DIR)/sm_$(subst $() ,_,$(strip $(CUDA_ARCHS)))
CUDA_OBJECTS = $(patsubst csrc/cuda/%.cu,$(CUDA_ARCH_DIR)/%.o,$(wildcard csrc/cuda/*.cu))
# Each .cu compiles on its own, so `make -j` checks them in parallel.
cuda-check: $(CUDA_OBJECTS) $(CUDA_CHECK_DIR)/bindings.checked

$(CUDA_CHECK_DIR)/bindings.checked: csrc/angpt_kernels.cpp $(wildcard csrc/*.h csrc/cpu/*.h csrc/cuda/*.h)
	@mkdir -p $(@D)
	$(CXX) -std=c++20 -fsyntax-only -DANGPT_WITH_CUDA -DTORCH_EXTENSION_NAME=cuda_check \
		$$($(PY) -c "import sysconfig; from torch.utils.cpp_extension import include_paths; \
		print(' '.join('-I' + p for p in [*include_paths(), sysconfig.get_paths()['include']]))") \
		csrc/angpt_kernels.cpp
	touch $@

$(CUDA_ARCH_DIR)/%.o: csrc/cuda/%.cu $(wildcard csrc/cuda/*.h csrc/cuda/*.cuh csrc/*.h)
	@mkdir -p $(@D)
	$(NVCC) -std=c++20 -O3 $(CUDA_GENCODE) $(TORCH_CUDA_FLAGS) -c $< -o $@

clean:
	rm -rf $(VENV) build *.egg-info angpt/kernels/_fused_*.so
