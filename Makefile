# Flotilla: `make demo` trains, registers, serves and queries the default model; `make test` runs the suite.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(VENV)/bin/pip
# torch is installed first, on its own: without an NVIDIA GPU the pinned release resolves to
# the CPU build; an unpinned torch pulls a multi-GB CUDA build.
# Elsewhere, point TORCH_PIP_ARGS at a CPU wheel index, e.g. TORCH_PIP_ARGS="--index-url <url>".
TORCH_VERSION  := 2.13.0
TORCH_PIP_ARGS ?=
PYTEST_ARGS    ?=
# `make test` runs the suite in two lanes at once (pytest-xdist's `--dist loadgroup`; tests/conftest.py
# marks each module's lane): on 2 cores it takes about 0.7 of one lane's time. TEST_LANES=0: one process.
# Then the tests marked `hosts` (test_hosts.py: four Ray nodes in namespaces, a kill and a drain timed
# against deadlines) run alone: beside a lane they took 3x their time and missed their deadlines.
# (Exit status 5, "no tests selected", of one phase is not a failure when the other ran tests.)
TEST_LANES     ?= 2
# `make docs-serve` listens here (Serve's endpoints take 8000).
DOCS_ADDR      ?= 127.0.0.1:8001

.PHONY: help install demo test test-unit test-services benchmark benchmark-tune benchmark-serve benchmark-predict benchmark-generate benchmark-runtimes benchmark-finetune benchmark-chat benchmark-adapters benchmark-elastic benchmark-comm cluster-local docs docs-serve clean

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  make %-19s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml requirements.lock
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	$(PIP) install --quiet torch==$(TORCH_VERSION) $(TORCH_PIP_ARGS)
	$(PIP) install --quiet -c requirements.lock -e '.[dev]'
	touch $@

install: $(VENV)/.installed ## create .venv and install Flotilla (the `flotilla` command) into it

demo: $(VENV)/.installed ## train the default model on a local Ray, register it, serve it, query it
	$(VENV)/bin/flotilla train --config configs/digits.yaml
	$(VENV)/bin/flotilla deploy --config configs/digits.yaml --query

test: $(VENV)/.installed test-services ## the whole suite: two lanes (TEST_LANES=0: one), then the hosts alone; PYTEST_ARGS passes options
	@lanes=0; hosts=0; \
	$(PY) -m pytest -n $(TEST_LANES) --dist loadgroup -m "not hosts" $(PYTEST_ARGS) || lanes=$$?; \
	$(PY) -m pytest -m hosts $(PYTEST_ARGS) || hosts=$$?; \
	[ $$lanes = 5 ] && [ $$hosts != 5 ] && lanes=0; [ $$hosts = 5 ] && [ $$lanes != 5 ] && hosts=0; \
	[ $$lanes = 0 ] && [ $$hosts = 0 ] || { echo "make test: lanes exit $$lanes, hosts exit $$hosts"; exit 1; }

test-unit: $(VENV)/.installed ## the unit tests only (no Ray, seconds)
	$(PY) -m pytest tests/unit $(PYTEST_ARGS)

test-services: ## install the servers the suite runs (PostgreSQL, Prometheus) where missing
	ops/install_test_services.sh

benchmark: $(VENV)/.installed ## training throughput against bare DeepSpeed and a bare torch loop
	$(PY) benchmarks/train_throughput.py

benchmark-tune: $(VENV)/.installed ## sweep overhead: trial start-up and the share of time spent training
	$(PY) benchmarks/tune_overhead.py --trials 4

benchmark-serve: $(VENV)/.installed ## serving requests/s and latency against plain FastAPI
	$(PY) benchmarks/serve_throughput.py

benchmark-predict: $(VENV)/.installed ## batch scoring rows/s and memory against one pandas process
	$(PY) benchmarks/batch_predict.py

benchmark-generate: $(VENV)/.installed ## gpt generation with the KV cache against recomputing the context
	$(PY) benchmarks/generate_cache.py

benchmark-runtimes: $(VENV)/.installed ## serving by serve.runtime: torch, ONNX and int8 ONNX of one model; a language model in 4 bits
	$(PY) benchmarks/serve_runtimes.py
	$(PY) benchmarks/lm_runtimes.py

benchmark-finetune: $(VENV)/.installed ## LoRA fine-tuning tokens/s against a bare transformers + peft loop
	$(PY) benchmarks/finetune_throughput.py

benchmark-chat: $(VENV)/.installed ## chat streams decoded together against a thread per stream
	$(PY) benchmarks/chat_batching.py

benchmark-adapters: $(VENV)/.installed ## 8 LoRA adapters on one base: memory, and tokens/s spread over them against one
	$(PY) benchmarks/adapters.py

benchmark-elastic: $(VENV)/.installed ## elastic runs on hosts of one machine: a kill and a drain against an undisturbed run (root)
	$(PY) benchmarks/elastic.py

benchmark-comm: $(VENV)/.installed ## train.comm options over 100 Mbit/s and 1 Gbit/s links between hosts of one machine (root, ~15 min)
	$(PY) benchmarks/comm.py --model gpt --link-mbit 100
	$(PY) benchmarks/comm.py --model gpt --link-mbit 1000

cluster-local: $(VENV)/.installed ## autoscaling on this machine (cluster.local.yaml), stopped when done
	$(PY) ops/local_autoscaling.py

docs: $(VENV)/.installed ## build the documentation site into site/ (strict: broken links fail)
	$(PY) -m mkdocs build --strict --site-dir site

docs-serve: $(VENV)/.installed ## serve the documentation site on 127.0.0.1:8001 (DOCS_ADDR) while you edit docs/
	$(PY) -m mkdocs serve --dev-addr $(DOCS_ADDR)

clean: ## remove runs, the local MLflow store and caches
	rm -rf runs mlruns mlflow.db .pytest_cache
