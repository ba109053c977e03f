# pagedllm developer tasks. `make test` is what CI runs (.ci/run calls it).
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
TORCH_VERSION ?= 2.13.0

.PHONY: venv test test-fast lint kernel-guard demo bench-scheduler bench clean

$(BIN)/.installed: pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch first, pinned: the CPU build; the package's own range then installs nothing more.
	$(BIN)/pip install -q torch==$(TORCH_VERSION)
	$(BIN)/pip install -q -e '.[test,serve,bench]'
	touch $@

venv: $(BIN)/.installed

test: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=20

# Style, import order and complexity (pyproject [tool.ruff]), then each package's line budget.
lint: venv
	$(BIN)/ruff check pagedllm tests benchmarks examples
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/test_line_budget.py

test-fast: venv
	$(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow"

# The C++ kernels' speed against torch's on this CPU, every x86 level it runs (CI runs it after
# the tests, alone on the machine: benchmarks/kernel_guard.py).
kernel-guard: venv
	$(BIN)/python -m benchmarks.kernel_guard

demo: venv
	$(BIN)/pagedllm generate "Once upon a time" --max-tokens 64

bench-scheduler: venv
	$(BIN)/python -m benchmarks.scheduler_overhead

clean:
	rm -rf $(VENV) build *.egg-info
