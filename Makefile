# The two commands of the README. Each bootstraps .venv on first use, on the Python 3.12+ that
# launch/find_python.sh finds (PYTHON=... names one; else python3.13/3.12 on PATH, pyenv's, uv's).
PYTHON ?=
VENV := .venv
PY := $(VENV)/bin/python
CONFIG ?= configs/quickstart.py
WORKDIR ?= runs/quickstart
PYTEST_ARGS ?=
# Which accelerator's jax plugin `make install` adds to the CPU set: cpu | cuda12 | cuda13 | tpu
# (locks/ACCEL.lock). It sticks: later make commands keep the venv's accelerator.
ACCEL ?= $(shell cat $(VENV)/.accel 2>/dev/null || echo cpu)
STAMP := $(VENV)/.installed-$(ACCEL)
TEST_STAMP := $(VENV)/.installed-test
# The compilers of hardware that is not here: JAX's CUDA plugin (with cuDNN) and libtpu, kept out of
# the venv's own packages so that CPU runs never try to load them. The plan tests put them on
# PYTHONPATH to compile for H100/H200 hosts and TPU slices (maxlm/bench/targets).
TARGET_COMPILERS := $(VENV)/target-compilers
# uv installs the locked sets in half pip's time (docs/testing.md); pip puts this pinned uv into the
# venv first, the release launch/tpu.py installs on workers. Bytecode is compiled at install, as pip
# does: where PYTHONDONTWRITEBYTECODE is set, every start would compile every module it imports.
UV_VERSION := 0.13.8
INSTALL := $(VENV)/bin/uv pip install --python $(PY) --quiet --compile-bytecode

.PHONY: train test test-ci bench install install-tensorboard install-wandb install-hf clean

train: $(STAMP)
	$(PY) -m maxlm.train --config=$(CONFIG) --workdir=$(WORKDIR)

test: $(STAMP) $(TEST_STAMP) $(TARGET_COMPILERS)/.installed
	MAXLM_TARGET_COMPILERS=$(abspath $(TARGET_COMPILERS)) $(PY) -m pytest -n 2 --dist loadgroup -m "not ci" $(PYTEST_ARGS)

# The slowest end-to-end runs (marked `ci`), left out of `make test` to keep it within 12 minutes:
# CI runs them after it (.ci/run).
test-ci: $(STAMP) $(TEST_STAMP) $(TARGET_COMPILERS)/.installed
	MAXLM_TARGET_COMPILERS=$(abspath $(TARGET_COMPILERS)) $(PY) -m pytest -n 2 --dist loadgroup -m ci $(PYTEST_ARGS)

bench: $(STAMP)
	$(PY) -m maxlm.bench --config=configs/tiny.py

install: $(STAMP)

# Reinstall whenever a pinned set or the package metadata changes.
$(STAMP): requirements.lock pyproject.toml $(wildcard locks/$(ACCEL).lock)
	@test "$(ACCEL)" = cpu || test -f locks/$(ACCEL).lock || { echo "ACCEL=$(ACCEL): no locks/$(ACCEL).lock (cpu, cuda12, cuda13 or tpu)"; exit 2; }
	@# a venv of an older Python (maxlm needed 3.11 before) is made again
	@$(PY) -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null || { \
		python=$$(PYTHON='$(PYTHON)' launch/find_python.sh) || exit 2; \
		echo "making $(VENV) with $$python"; rm -rf $(VENV) && $$python -m venv $(VENV); }
	$(PY) -m pip install --quiet uv==$(UV_VERSION)
	$(INSTALL) -r requirements.lock $(if $(filter-out cpu,$(ACCEL)),-r locks/$(ACCEL).lock)
	$(INSTALL) --no-deps -e .
	echo $(ACCEL) > $(VENV)/.accel
	touch $(STAMP)

$(TEST_STAMP): $(STAMP) requirements-test.lock requirements-test.overrides
	$(INSTALL) -r requirements.lock -r requirements-test.lock --override requirements-test.overrides
	touch $(TEST_STAMP)

$(TARGET_COMPILERS)/.installed: $(STAMP) locks/cuda12.lock locks/tpu.lock
	rm -rf $(TARGET_COMPILERS)
	$(INSTALL) --no-deps --target $(TARGET_COMPILERS) -c locks/cuda12.lock -c locks/tpu.lock \
		jax-cuda12-plugin jax-cuda12-pjrt nvidia-cudnn-cu12 libtpu
	touch $@

# Optional pieces the docs use, at the versions the tests run (requirements-test.lock): the
# TensorBoard viewer, wandb for metrics.wandb=True, and torch + transformers to load an export in transformers (PyPI's Linux torch
# is its CUDA build, several GB, and runs on the CPU too).
install-tensorboard: $(STAMP)
	$(INSTALL) -c requirements.lock -c requirements-test.lock tensorboard

install-wandb: $(STAMP)
	$(INSTALL) -c requirements.lock -c requirements-test.lock wandb

install-hf: $(STAMP)
	$(INSTALL) -c requirements.lock -c requirements-test.lock torch transformers

clean:
	rm -rf $(VENV) runs .pytest_cache
