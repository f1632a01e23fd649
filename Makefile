# The two commands of the README. Each bootstraps .venv on first use (only Python 3.11+ needed).
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
CONFIG ?= configs/quickstart.py
WORKDIR ?= runs/quickstart
PYTEST_ARGS ?=

.PHONY: train test bench install clean

train: $(STAMP)
	$(PY) -m maxlm.train --config=$(CONFIG) --workdir=$(WORKDIR)

test: $(STAMP)
	$(PY) -m pytest -n 2 --dist loadgroup $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m maxlm.bench --config=configs/tiny.py

install: $(STAMP)

# Reinstall whenever the pinned set or the package metadata changes.
$(STAMP): requirements.lock pyproject.toml
	@$(PYTHON) -c 'import sys; assert sys.version_info >= (3, 11), "maxlm needs Python 3.11+, found " + sys.version.split()[0]'
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.lock
	$(PY) -m pip install --quiet --no-deps -e .
	touch $(STAMP)

clean:
	rm -rf $(VENV) runs .pytest_cache
