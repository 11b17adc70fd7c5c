# selfattn: `make demo` and `make test` install everything they need first; `make help` lists
# every target.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

# bash with pipefail, so that a command piped through the filter below still fails the target.
SHELL := bash
.SHELLFLAGS := -eo pipefail -c

# pip, quiet. Some machines' pip configuration names package folders that lack some packages,
# and pip then warns once per package ("Location ... is ignored: it is neither a file nor a
# directory"); those lines are dropped, any other warning or error still shows.
PIP_INSTALL = $(PY) -m pip install -q --progress-bar off $(1) 2>&1 \
	| { grep -v 'is ignored: it is neither a file nor a directory' || true; }

.DEFAULT_GOAL := help
.PHONY: help install browser demo test test-fast lint format bench clean

help:
	@echo "selfattn: make TARGET  (each target first installs what it needs into $(VENV)/)"
	@echo "  demo       install, then explain 'bank' in a sentence on all-MiniLM-L6-v2; writes bank.html"
	@echo "  test       install (and Debian's chromium for the browser tests), then the whole suite"
	@echo "  test-fast  the same without the tests marked slow"
	@echo "  lint       ruff check and ruff format --check (src, tests, benchmarks)"
	@echo "  format     ruff format and ruff check --fix (rewrites files)"
	@echo "  bench      two CPU benchmarks of docs/benchmarks.md, attention.py --quick and encode.py (about 6 minutes on 2 idle cores)"
	@echo "  install    only create $(VENV)/ and install selfattn with its [dev] extras"
	@echo "  browser    only install Debian's chromium for the browser tests (make test does it too)"
	@echo "  clean      remove $(VENV)/, caches, build output and bank.html (runs/ is kept)"
	@echo "Then: . $(VENV)/bin/activate, and selfattn --help"

install: $(STAMP)

# torch: on a machine without a GPU (no nvidia-smi) torch 2.13.0 is installed first, which pip
# takes from a local CPU wheel where its configuration has one; a GPU machine takes the default.
$(STAMP): pyproject.toml Makefile
	@if [ ! -x $(PY) ]; then \
		$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null \
		|| { echo "$(PYTHON) is missing or older than Python 3.10; name another: make $(or $(MAKECMDGOALS),install) PYTHON=python3.11" >&2; exit 1; }; \
		echo "creating $(VENV)/ with $$($(PYTHON) --version)"; \
		$(PYTHON) -m venv $(VENV); \
	fi
	@if ! command -v nvidia-smi >/dev/null 2>&1; then \
		echo "installing torch 2.13.0 (CPU build)"; \
		$(call PIP_INSTALL,torch==2.13.0); \
	fi
	@echo "installing selfattn and its [dev] extras (all-MiniLM-L6-v2, pytest, ruff, transformers, ...)"
	@$(call PIP_INSTALL,-e '.[dev]')
	@touch $(STAMP)
	@echo "installed into $(VENV)/"

# The browser tests drive Debian's chromium at /usr/bin/chromium; without it they are skipped.
browser:
	@if [ ! -x /usr/bin/chromium ]; then \
		echo "installing Debian's chromium for the browser tests"; \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium >/dev/null; } \
		|| echo "warning: could not install chromium; the browser tests will be skipped"; \
	fi

# The main job on the default model; also writes the interactive page bank.html.
demo: install
	$(VENV)/bin/selfattn explain "I went to the bank to deposit money." --word bank --html bank.html
	@echo "Open bank.html in a browser. More: . $(VENV)/bin/activate, then selfattn --help (README.md)"

# Two workers (pytest-xdist), whole test files to each: about 10 minutes on 2 cores, against
# 14 for one; TEST_WORKERS=N for more (each holds its own models and browser).
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install browser
	$(PYTEST)

test-fast: install browser
	$(PYTEST) -m "not slow"

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
	rm -rf $(VENV) .pytest_cache .ruff_cache .hypothesis build dist src/*.egg-info bank.html
	find src tests benchmarks -name __pycache__ -type d -prune -exec rm -rf {} +
