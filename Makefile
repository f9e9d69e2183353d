# Two commands on a fresh clone: `make serve` and `make test`.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
PY := $(VENV)/bin/python
DEMO_MODEL := .cache/demo-model
MODEL ?=
PORT ?= 8000

.PHONY: install serve test lint bench clean

$(VENV)/.installed: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# The CPU wheel of torch 2.13.0 lies on this machine's disk; any other spec pulls a CUDA build.
	$(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[test]'
	touch $@

install: $(VENV)/.installed

$(DEMO_MODEL)/config.json: | $(VENV)/.installed
	$(VENV)/bin/openinfer demo-model $(DEMO_MODEL)

# The OpenAI-compatible server on localhost:$(PORT): the demo model unless MODEL=path.
serve: $(VENV)/.installed $(if $(MODEL),,$(DEMO_MODEL)/config.json)
	$(VENV)/bin/openinfer serve --model $(if $(MODEL),$(MODEL),$(DEMO_MODEL)) \
		--served-model-name $(if $(MODEL),$(notdir $(MODEL)),demo) --port $(PORT)

test: $(VENV)/.installed
	$(PY) -m ruff check .
	$(PY) -m pytest -q

bench: $(VENV)/.installed
	$(PY) benchmarks/bench_offline.py

clean:
	rm -rf $(VENV) .cache
