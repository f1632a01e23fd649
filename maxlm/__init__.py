"""maxlm: pretraining decoder-only Transformers with JAX, Flax, optax, grain and orbax.

Importing the package sets one XLA flag for the *CPU* backend (accelerators ignore `xla_cpu_*`
flags), before any JAX backend starts: matmuls and reductions run as YNNPACK fusions
(`--xla_cpu_experimental_ynn_fusion_type=dot,reduce`), measured 8-12% faster than XLA:CPU's own
code on the tiny and 50M configs on jaxlib 0.10, about 1.25x on 0.12 (docs/performance.md). Elementwise fusions (`eltwise`) are left
out: XLA emits YNN elementwise fusions for operands with non-default layouts, which it then
rejects at run time ("Instruction with unsupported layout in YNN fusion"), as the
sequence-parallel eval step did; they were also slower. `MAXLM_XLA_CPU_DEFAULTS=0` turns the flag
off; a value already in XLA_FLAGS wins; other jaxlib series don't get it (XLA aborts on flags it
does not know).
"""

import importlib.metadata
import os

# XLA_FLAGS as the environment gave them, before the default below is added (maxlm.compare passes
# these, not maxlm's, to the code it compares with).
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
CPU_DEFAULT = f"{CPU_FLAG}=dot,reduce"
# XLA aborts on a flag it does not know, and experimental flags come and go: only for the jaxlib
# series this was measured with (0.10, and 0.12 of requirements.lock; docs/performance.md).
_TESTED_JAXLIB = ("0.10.", "0.12.")


def _jaxlib_version() -> str:
    try:
        return importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        return ""


if (os.environ.get("MAXLM_XLA_CPU_DEFAULTS", "1") != "0"
        and CPU_FLAG not in os.environ.get("XLA_FLAGS", "")
        and _jaxlib_version().startswith(_TESTED_JAXLIB)):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_DEFAULT}".strip()
