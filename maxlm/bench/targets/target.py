"""What a plan needs to know of hardware it compiles for (maxlm/bench/targets/__init__.py)."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Target:
    name: str
    platform: str  # what jax.default_backend() says on the real machine (config key `platform`)
    devices: tuple  # the target's devices, for mesh.make_mesh
    hosts: int  # processes, as many as the real job would have
    slices: int  # TPU slices joined over the data-center network (1 for GPUs)
    memory_bytes: int  # one device's memory
    usable_bytes: int  # what JAX may allocate of it: a plan fits when its peak is within this
    memory_bytes_per_sec: int  # one device's memory bandwidth, for the estimated step time

    @property
    def device_kind(self) -> str:
        return self.devices[0].device_kind
