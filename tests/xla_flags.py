"""The XLA flags every test process runs with, in-process and in the commands tests start.

`--xla_backend_optimization_level=0`: XLA:CPU's LLVM passes at their lowest level. The suite's
programs are tiny and run a few steps, so compiling them is most of its time; at level 0 a test
compiles in about half the time and runs the same HLO (docs/testing.md, with measurements).
Commands users run keep XLA's default level, and so do the tests that compile for a GPU or TPU
target (`bench plan --target`): the flag is every backend's, and those compiles are what ships.
"""

FAST_COMPILE = "--xla_backend_optimization_level=0"


def with_test_flags(xla_flags: str) -> str:
    return f"{xla_flags} {FAST_COMPILE}".strip()


def without_test_flags(xla_flags: str) -> str:
    return " ".join(flag for flag in xla_flags.split() if flag != FAST_COMPILE)
