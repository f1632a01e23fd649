"""maxlm: pretraining decoder-only Transformers with JAX, Flax, optax, grain and orbax.

Importing the package adds one XLA flag for the *CPU* backend (accelerators ignore `xla_cpu_*`
flags), before any JAX backend starts: elementwise ops and reductions join the YNNPACK fusions that
already run the matmuls. Without it, XLA:CPU fuses the transpose that feeds each weight-gradient
matmul into the elementwise op before it and emits that fusion untiled, about 10x slower than a
plain transpose; the CPU profile of a 50M model at seq 1024 spent a fifth of the step there.
`MAXLM_XLA_CPU_DEFAULTS=0` turns it off; a value already in XLA_FLAGS wins; other jaxlib series
don't get it (XLA aborts on flags it does not know).
"""

import importlib.metadata
import os

_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_CPU_DEFAULT = f"{_CPU_FLAG}=dot,eltwise,reduce"
# XLA aborts on a flag it does not know, and experimental flags come and go: only for the jaxlib
# series this was measured with (requirements.lock).
_TESTED_JAXLIB = "0.10."


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


if (os.environ.get("MAXLM_XLA_CPU_DEFAULTS", "1") != "0"
        and _CPU_FLAG not in os.environ.get("XLA_FLAGS", "")
        and _jaxlib_version().startswith(_TESTED_JAXLIB)):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_DEFAULT}".strip()
