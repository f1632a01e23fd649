"""Multi-process bootstrap from standard environment variables (a no-op for one process).

    JAX_COORDINATOR_ADDRESS=host:port  JAX_NUM_PROCESSES=N  JAX_PROCESS_ID=i

Launchers set these; each process then sees all processes' devices in `jax.devices()`. On CPU the
cross-process collectives use gloo. Must run before anything touches a JAX backend.
"""

from __future__ import annotations

import os

import jax


def initialize() -> bool:
    """Calls jax.distributed.initialize when JAX_COORDINATOR_ADDRESS is set; True if it did."""
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if not address:
        return False
    if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=address,
        num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
        process_id=int(os.environ["JAX_PROCESS_ID"]),
    )
    return True
