# Flotilla: `make demo` trains, registers, serves and queries the default model; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch is installed first, on its own: without an NVIDIA GPU the pinned release resolves to
# the CPU build (see ../shared/MACHINE_NOTES.md); an unpinned torch pulls a multi-GB CUDA build.
# Elsewhere, point TORCH_PIP_ARGS at a CPU wheel index, e.g. TORCH_PIP_ARGS="--index-url <url>".
TORCH_VERSION  := 2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS    ?=

.PHONY: demo test test-unit test-integration install clean benchmark benchmark-tune benchmark-serve cluster-local

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(PIP) install --quiet -c requirements.lock -e '.[dev]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(PY) pipelines/train.py --config configs/digits.yaml
	$(PY) pipelines/deploy.py --config configs/digits.yaml --query

test: $(VENV)/.installed
	$(PY) -m pytest $(PYTEST_ARGS)

test-unit: $(VENV)/.installed
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

benchmark: $(VENV)/.installed
	$(PY) benchmarks/train_throughput.py

benchmark-tune: $(VENV)/.installed
	$(PY) benchmarks/tune_overhead.py --trials 4

benchmark-serve: $(VENV)/.installed
	$(PY) benchmarks/serve_throughput.py

# Autoscaling on this machine: cluster.local.yaml's head (no CPUs), a training job that needs
# worker nodes, the autoscaler adding them and removing them when idle; stops what it started.
cluster-local: $(VENV)/.installed
	$(PY) ops/local_autoscaling.py

clean:
	rm -rf runs mlruns mlflow.db .pytest_cache
