"""maxlm: pretraining decoder-only Transformers with JAX, Flax, optax, grain and orbax.

Importing the package adds one XLA flag for the *CPU* backend (accelerators ignore `xla_cpu_*`
flags), before any JAX backend starts: elementwise ops and reductions join the YNNPACK fusions that
already run the matmuls. Without it, XLA:CPU fuses the transpose that feeds each weight-gradient
matmul into the elementwise op before it and emits that fusion untiled, about 10x slower than a
plain transpose; the CPU profile of a 50M model at seq 1024 spent a fifth of the step there.
`MAXLM_XLA_CPU_DEFAULTS=0` turns it off; a value already in XLA_FLAGS wins.
"""

import os

_CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
_CPU_DEFAULT = f"{_CPU_FLAG}=dot,eltwise,reduce"

if os.environ.get("MAXLM_XLA_CPU_DEFAULTS", "1") != "0" and _CPU_FLAG not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_CPU_DEFAULT}".strip()
