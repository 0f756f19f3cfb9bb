# Two commands set kiln up on a fresh machine: `make train` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# Pinned so pip picks the CPU wheel; an unpinned torch pulls several GB of CUDA wheels.
TORCH_PIN ?= torch==2.13.0

.PHONY: train test install install-test clean bench gpu-preflight gpu-check gpu-merge gpu-wheels

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	@if $(PY) -c "import torch, sys; v = tuple(int(p) for p in torch.__version__.split('+')[0].split('.')[:2]); sys.exit(0 if v >= (2, 9) else 1)" 2>/dev/null; \
	then echo "torch already importable"; \
	else $(PIP) install --quiet "$(TORCH_PIN)"; fi
	$(PIP) install --quiet -e .
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install --quiet -e ".[test]"
	touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

train: install
	$(VENV)/bin/kiln train

# The suite, without the gpu_preflight tests (docs/testing.md: ≤ 12 min on the slowest CPU measured).
test: install-test
	$(PY) -m pytest -q --durations=15 -m "not gpu_preflight" tests

# Step 1 before any GPU window, on this CPU: every GPU launch of the kernels compiled with ptxas, the GPU suite's dry
# run and its merge into docs/benchmarks.md (the pytest marker gpu_preflight; docs/benchmarks.md, "GPU suite").
gpu-preflight: install-test
	$(PY) -m pytest -q --durations=5 -m gpu_preflight tests

bench: install
	$(PY) benchmarks/throughput.py

# On a machine with one CUDA GPU: tests, throughput vs a plain loop, estimator grid, kernels (docs/benchmarks.md).
# No install step: it runs with the python3 that already holds a CUDA torch, triton and pytest (GPU machines are
# often offline, and `make install` would pull the CPU wheel); `make gpu-check GPU_PYTHON=...` picks another.
GPU_PYTHON ?= python3
gpu-check:
	if ls .whl/*.whl >/dev/null 2>&1; then $(GPU_PYTHON) -m pip install -q --no-index --no-deps --target .whl/site .whl/*.whl; fi
	PYTHONPATH=.:.whl/site $(GPU_PYTHON) benchmarks/gpu_suite.py --out gpu-results

# The GPU machine has no network and no torchao: its wheel (pure Python, abi3) is fetched here into .whl/ (ignored by
# git) and carried; gpu-check puts it on the path when it is there, else the suite's fp8 part records why it did not run.
gpu-wheels:
	$(PYTHON) -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl torchao

# Then: gpu-results' tables into docs/benchmarks.md between its gpu-suite markers (refuses dry-run results).
gpu-merge:
	PYTHONPATH=. $(GPU_PYTHON) benchmarks/gpu_suite.py merge gpu-results

clean:
	rm -rf $(VENV) runs build *.egg-info
