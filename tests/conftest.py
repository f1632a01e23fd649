"""Test setup, before JAX is imported anywhere: 8 fake CPU devices, and one JAX compilation cache
for the whole run.

The cache is shared by both xdist workers and by every maxlm command a test starts (through the
environment: tests.helpers.command_env). Many tests compile the same programs (the tiny config's
train step on 8 devices, above all in the subprocess tests that kill and restart runs); a program
compiled once is then loaded, not compiled again. An executable loaded from the cache is the one
XLA compiled, so the numbers are the same (the bitwise resume and determinism tests run with it).
It lives for one run: every run starts cold, as CI does.
"""

import os
import shutil
import tempfile
import uuid

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
_RUN = os.environ.get("PYTEST_XDIST_TESTRUNUID") or uuid.uuid4().hex  # the same in every worker
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR",
                      os.path.join(tempfile.gettempdir(), f"maxlm-test-jax-cache-{_RUN}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")


import pytest  # noqa: E402  (after XLA_FLAGS, which must be set before JAX is imported)


def pytest_sessionfinish(session):
    """The controller (or a run without xdist) removes the run's compilation cache at the end."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)


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


@pytest.fixture(scope="session")
def sp_model(tmp_path_factory):
    """A small sentencepiece BPE model (pad 0, unk 1, bos 2, eos 3) trained on code-like text."""
    import sentencepiece as spm

    d = tmp_path_factory.mktemp("sp")
    text = "\n".join(f"def fn_{i}(x, y):\n    return x * {i} + y  # café" for i in range(300))
    (d / "corpus.txt").write_text(text, encoding="utf-8")
    spm.SentencePieceTrainer.train(
        input=str(d / "corpus.txt"), model_prefix=str(d / "tok"), vocab_size=300,
        model_type="bpe", byte_fallback=True, character_coverage=1.0,
        pad_id=0, unk_id=1, bos_id=2, eos_id=3,
        normalization_rule_name="identity", remove_extra_whitespaces=False,
        hard_vocab_limit=False, num_threads=1, minloglevel=2,
    )  # fmt: skip
    return d / "tok.model"
