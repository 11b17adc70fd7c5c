# selfattn: `make demo` and `make test` install everything they need first.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install demo test test-fast lint format bench clean

install: $(STAMP)

# torch: the CPU build (on local disk) when there is no GPU; a GPU machine takes the default.
$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	if ! command -v nvidia-smi >/dev/null 2>&1; then $(PY) -m pip install -q torch==2.13.0; fi
	$(PY) -m pip install -q -e '.[dev]'
	@if [ ! -x /usr/bin/chromium ]; then \
		echo "installing Debian's chromium for the browser tests"; \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null \
		|| echo "warning: could not install chromium; browser tests will be skipped"; \
	fi
	touch $(STAMP)

# The main job on the default model; also writes the interactive page bank.html.
demo: install
	$(VENV)/bin/selfattn explain "I went to the bank to deposit money." --word bank --html bank.html

test: install
	$(PY) -m pytest -q

test-fast: install
	$(PY) -m pytest -q -m "not slow"

lint: install
	$(VENV)/bin/ruff check src tests benchmarks
	$(VENV)/bin/ruff format --check src tests benchmarks

format: install
	$(VENV)/bin/ruff format src tests benchmarks
	$(VENV)/bin/ruff check --fix src tests benchmarks

# About 6 minutes on 2 idle cores: the attention table up to T = 2,048 and the encode table.
# The full attention table (T to 65,536, ~10-15 minutes): $(PY) benchmarks/attention.py
bench: install
	$(PY) benchmarks/attention.py --quick
	$(PY) benchmarks/encode.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis
