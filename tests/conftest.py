"""Test setup, before JAX is imported anywhere: 8 fake CPU devices.

No persistent compilation cache: XLA:CPU loses the order of the collectives of a multi-device
executable it loads from one, and the fake devices then deadlock until XLA aborts the process
(docs/testing.md; maxlm.cli.use_compile_cache turns it off for the same reason). Every test
compiles its programs.
"""

import os

from xla_flags import with_test_flags

os.environ["XLA_FLAGS"] = with_test_flags(
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)
os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["JAX_ENABLE_COMPILATION_CACHE"] = "false"  # whatever the caller's environment sets up

import pytest  # noqa: E402  (after XLA_FLAGS, which must be set before JAX is imported)

pytest_plugins = ["pytester"]  # tests/test_budget.py runs the suite's own hooks in a pytest of its own

from maxlm import cli  # noqa: E402

cli.set_xla_cpu_defaults()  # as every command does: tests run the CPU code the commands run


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


@pytest.hookimpl(trylast=True)  # after xdist's own hook, which no longer takes effect (below)
def pytest_collection_modifyitems(config, items):
    """Worker groups for `--dist loadgroup`.

    The tests of a module that share a module-scoped fixture (a trained run, reference losses:
    10-40 s each) join one group, so the fixture is built once, not once per worker.

    xdist sends the tests whose node ids end in `@GROUP` to one worker. xdist 3.8 appends the
    suffix by assigning `item._nodeid`, which pytest 9.2 no longer reads (a node's id is now
    `item._id`, a NodeId), so every group, the `xdist_group` marks' included, was ignored. Until
    xdist follows, the suffix is set here the way pytest 9.2 stores ids.
    """
    if not getattr(config.option, "loadgroup", False):  # set on xdist workers only
        return
    from _pytest.nodeid import NodeId

    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info and any(d.scope == "module" for defs in info.name2fixturedefs.values() for d in defs):
            item.add_marker(pytest.mark.xdist_group(item.module.__name__))
        names = sorted({str(m.args[0] if m.args else m.kwargs.get("name", "default"))
                        for m in item.iter_markers("xdist_group")})
        if names and "@" not in item.nodeid:
            item._id = NodeId.parse(f"{item.nodeid}@{'_'.join(names)}")


# The budget of one test in each tier (docs/testing.md#tiers-and-their-cost). The tiers stay inside
# their minutes only if no single test grows unnoticed; the budgets leave room for a loaded CI
# machine (about 2.5x slower than a quiet one), so a test past one has grown, not been unlucky.
# MAXLM_TEST_BUDGET_SCALE scales them for a machine known to be slower.
BUDGET_SEC = {"make test": 300, "ci": 900}
BUDGET_SCALE = float(os.environ.get("MAXLM_TEST_BUDGET_SCALE", "1"))  # read once, as the run starts


def over_budget(seconds: float, tier: str) -> str | None:
    """The failure message for a test phase that took `seconds` in `tier`, or None within budget."""
    budget = BUDGET_SEC[tier] * BUDGET_SCALE
    if seconds <= budget:
        return None
    return (f"took {seconds:.1f} s, past the {budget:g} s budget of a `{tier}` test "
            "(docs/testing.md#tiers-and-their-cost): make it cheaper, or move it to the ci tier")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A passing test's setup or call past its tier's budget is reported as failed."""
    report = (yield).get_result()
    if call.when in ("setup", "call") and report.passed:
        message = over_budget(call.duration, "ci" if item.get_closest_marker("ci") else "make test")
        if message:
            report.outcome = "failed"
            report.longrepr = f"{item.nodeid} ({call.when}) {message}"
