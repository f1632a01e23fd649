"""Test setup: 8 fake CPU devices, set before JAX is imported anywhere."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")


import pytest  # noqa: E402  (after XLA_FLAGS, which must be set before JAX is imported)


@pytest.fixture(scope="session")
def data_dirs(tmp_path_factory):
    """One built-in corpus and packed cache for the whole test run, shared by xdist workers.

    maxlm.data builds both atomically under file locks, so concurrent first users are safe, and
    every cache is keyed by all that shapes it (seq_len, tokenizer, ...).
    """
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above each worker's own
    root = root / "maxlm-data"
    return {"data.tfds_dir": str(root / "tfds"), "data.cache_dir": str(root / "packed")}
