"""The device mesh and the logical-axis → mesh-axis mapping.

Every parameter and main activation carries *logical* axis names (`batch`, `embed`, `heads`, ...).
The config's `mesh.rules` maps them onto the six mesh axes:

  stage    : pipeline parallelism: the scanned layers split into stages (maxlm/model/parallel/pipeline.py)
  data     : pure data parallelism (parameters replicated)
  fsdp     : data parallelism with parameters, gradients and optimizer state sharded (ZeRO-3)
  expert   : expert parallelism: an MoE layer's experts split over it, tokens sent to their experts'
             devices and back (`maxlm/model/moe/expert_parallel.py`); data parallelism everywhere else
  sequence : sequence parallelism: activations split along their length, keys/values all-gathered
             for attention (must lie within one process: see `check_sequence_local`)
  tensor   : Megatron-style splits of heads, MLP hidden units and vocabulary

so a mesh sweep edits config only. On several TPU slices or GPU nodes, `mesh.dcn_data`,
`mesh.dcn_fsdp` and `mesh.dcn_expert` split `data` / `fsdp` / `expert` across them (a hybrid mesh:
see `hybrid_device_grid`).
"""

from __future__ import annotations

import contextlib
import functools
import math

import flax.linen as nn
import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec

from maxlm.config.mesh_axes import DCN_AXES, MESH_AXES, check_dcn
from maxlm.runtime.errors import ConfigError


def _granule_key(devices) -> str:
    """What a granule is: a slice on TPU; a process on GPU/CPU (one per node under SLURM), whose
    devices report slice 0 for all processes or carry no `slice_index`."""
    tpu_slices = devices[0].platform == "tpu" and hasattr(devices[0], "slice_index")
    return "slice_index" if tpu_slices else "process_index"


def num_granules(devices=None) -> int:
    """How many granules `devices` (default: all) come in: TPU slices, or processes on GPU/CPU.
    Devices in one granule talk over ICI/NVLink; granules talk over DCN/the network."""
    devices = jax.devices() if devices is None else devices
    key = _granule_key(devices)
    return len({getattr(d, key) for d in devices})


def dcn_shape(mesh_cfg) -> tuple[int, ...]:
    """Granules along each mesh axis (`mesh.dcn_data`, `dcn_fsdp`, `dcn_expert`; 1 for the others)."""
    return tuple(int(mesh_cfg[f"dcn_{axis}"]) if axis in DCN_AXES else 1 for axis in MESH_AXES)


def hybrid_device_grid(mesh_cfg, devices) -> np.ndarray:
    """The devices as a [stage, data, fsdp, expert, sequence, tensor] array whose `data`, `fsdp` and
    `expert` axes are split `dcn_data`, `dcn_fsdp` and `dcn_expert` ways across granules: the mesh is
    a grid of granules, each granule a contiguous [stage, data/dcn_data, fsdp/dcn_fsdp,
    expert/dcn_expert, sequence, tensor] block (arranged for ICI inside a slice), so only the
    collectives of the dcn-split axes cross granules."""
    dcn = dcn_shape(mesh_cfg)
    ici = tuple(int(mesh_cfg[axis]) // n for axis, n in zip(MESH_AXES, dcn))
    return mesh_utils.create_hybrid_device_mesh(
        ici, dcn, devices, process_is_granule=_granule_key(devices) == "process_index"
    )


def make_mesh(mesh_cfg, devices=None) -> Mesh:
    """A Mesh over `devices` (default: all) shaped by the resolved `mesh_cfg`.

    `jax.make_mesh` orders devices to follow the physical topology (ICI rings on TPU), so the
    innermost axes (`tensor`, then `sequence`, then `expert`) get the fastest links. With a
    `mesh.dcn_*` > 1, a hybrid mesh (`hybrid_device_grid`) puts those axes' outer splits across
    granules. Where the topology's layout puts the `sequence` axis across processes, the
    processes' own blocks are used instead (`process_local_grid`). Raises ConfigError when the dcn
    factors do not match the granules, or when the `sequence` axis still spans processes
    (`check_sequence_local`).
    """
    shape = tuple(int(mesh_cfg[axis]) for axis in MESH_AXES)
    devices = jax.devices() if devices is None else devices
    # Auto axes: GSPMD propagates shardings from the jit in/out shardings and our constraints.
    axis_types = (AxisType.Auto,) * len(MESH_AXES)
    if math.prod(dcn_shape(mesh_cfg)) == 1:
        mesh = jax.make_mesh(shape, MESH_AXES, axis_types=axis_types, devices=devices)
        if not _sequence_is_local(mesh.devices, MESH_AXES) and (grid := process_local_grid(shape, devices)) is not None:
            mesh = Mesh(grid, MESH_AXES, axis_types=axis_types)
    else:
        check_dcn(mesh_cfg, num_granules(devices))
        mesh = Mesh(hybrid_device_grid(mesh_cfg, devices), MESH_AXES, axis_types=axis_types)
    check_sequence_local(mesh.devices, MESH_AXES)
    return mesh


def process_local_grid(shape: tuple[int, ...], devices) -> np.ndarray | None:
    """A [stage, data, fsdp, expert, sequence, tensor] device grid in which each process holds
    whole blocks of the inner axes: the processes split the outer axes (fsdp first, then data,
    expert, stage) and each arranges its own devices for the rest. None when the process count
    does not factor into the outer axes. `jax.make_mesh` follows the physical topology instead,
    which on a TPU pod can lay `sequence` across two hosts (a v5p-64's 4 x 4 x 2 chips, 4 a host)."""
    processes = len({d.process_index for d in devices})
    dcn, left = [1] * len(shape), processes
    for axis in (MESH_AXES.index(a) for a in ("fsdp", "data", "expert", "stage")):
        dcn[axis] = math.gcd(shape[axis], left)
        left //= dcn[axis]
    if left > 1:
        return None
    ici = tuple(n // d for n, d in zip(shape, dcn))
    try:
        return mesh_utils.create_hybrid_device_mesh(ici, dcn, devices, process_is_granule=True)
    except (ValueError, AssertionError, NotImplementedError):  # uneven processes, a layout it cannot make
        return None


def _sequence_is_local(grid: np.ndarray, axis_names, length_axes=("sequence",)) -> bool:
    names = list(axis_names)
    axes = [names.index(a) for a in length_axes if a in names]
    size = math.prod(grid.shape[a] for a in axes)
    if size == 1:
        return True
    owner = np.vectorize(lambda d: d.process_index, otypes=[int])(grid)
    rest = [a for a in range(grid.ndim) if a not in axes]
    owner = owner.transpose(rest + axes).reshape(-1, size)
    return bool((owner == owner[:, :1]).all())


def check_sequence_local(grid: np.ndarray, axis_names, length_axes=("sequence",)) -> None:
    """Raises ConfigError unless the devices that split one row's length (along `length_axes`) all
    belong to one process. Each process then reads whole rows (`batch_parts`), as without sequence
    parallelism; in practice: mesh.sequence x mesh.tensor divides the devices per process."""
    if not _sequence_is_local(grid, axis_names, length_axes):
        size = math.prod(grid.shape[list(axis_names).index(a)] for a in length_axes if a in axis_names)
        processes = len({d.process_index for d in grid.flat})
        raise ConfigError(
            f"mesh.sequence={size} spans processes: the devices splitting one sequence must belong "
            f"to one process ({grid.size // processes} devices each here); make "
            "mesh.sequence (x mesh.tensor) divide the devices per process"
        )


def rules_of(mesh_cfg) -> tuple:
    """The config's rules as the tuple-of-pairs Flax expects (JSON round trips turn them to lists)."""
    return tuple(
        (name, tuple(axes) if isinstance(axes, (list, tuple)) else axes)
        for name, axes in mesh_cfg.rules
    )


def logical_to_shardings(logical_specs, mesh: Mesh, rules):
    """Maps a pytree of logical PartitionSpecs to NamedShardings on `mesh`."""
    return nn.logical_to_mesh_sharding(logical_specs, mesh, rules)


def batch_sharding(mesh: Mesh, rules) -> NamedSharding:
    """Sharding of a [batch, length] input array."""
    return logical_to_shardings(PartitionSpec("batch", "length"), mesh, rules)


@functools.lru_cache(maxsize=16)
def batch_parts(mesh: Mesh, rules, process_index: int | None = None) -> tuple[tuple[int, ...], int]:
    """The rows of the global batch that `process_index`'s (default: this process's) devices
    hold, as `(parts, count)`: split the batch into `count` equal parts, it holds `parts`
    (ascending; the coarsest such split). What the process reads from the data pipeline, so the
    global batch is the same on any mesh and process count.

    Usually one part (`((p,), P)` for process p of P on a plain mesh); a process can hold several
    separate parts (hybrid meshes with fsdp split across granules) or all rows (`((0,), 1)`, the
    batch axes inside one process).
    """
    process_index = jax.process_index() if process_index is None else process_index
    axes = nn.logical_to_mesh_axes(PartitionSpec("batch"), rules)[0]
    axes = () if axes is None else (axes,) if isinstance(axes, str) else tuple(axes)
    return grid_batch_parts(mesh.devices, mesh.axis_names, axes, process_index)


def grid_batch_parts(grid: np.ndarray, axis_names, batch_axes, process_index: int):
    """`batch_parts` for a device array `grid` with `axis_names`, the batch split over `batch_axes`
    (major to minor, as a PartitionSpec entry splits a dimension)."""
    names = list(axis_names)
    sizes = [grid.shape[names.index(a)] for a in batch_axes]
    count = math.prod(sizes)
    held = {
        int(np.ravel_multi_index([coords[names.index(a)] for a in batch_axes], sizes)) if sizes else 0
        for coords in np.ndindex(grid.shape) if grid[coords].process_index == process_index
    }
    if not held:
        raise ValueError(f"process {process_index} has no device in the mesh")
    for group in sorted((g for g in range(1, count + 1) if count % g == 0), reverse=True):
        merged = {h // group for h in held}
        if len(merged) * group == len(held):  # every part of each merged group is held
            return tuple(sorted(merged)), count // group
    raise AssertionError("unreachable: groups of 1 always merge")


def global_batch(numpy_batch: dict, mesh: Mesh, rules) -> dict:
    """This process's rows → one global jax.Array per key, sharded as the `batch` rule says (data, fsdp, expert)."""
    sharding = batch_sharding(mesh, rules)
    return {k: jax.make_array_from_process_local_data(sharding, np.asarray(v))
            for k, v in numpy_batch.items()}


def read_batch(dataset, step: int, mesh: Mesh, rules) -> dict:
    """Global batch `step` of `dataset` (a `data.TokenDataset` or anything with its
    `batch(step, parts, count)`), each process reading only the rows its devices hold
    (`batch_parts`), so the global batch is the same on any mesh and process count."""
    parts, count = batch_parts(mesh, rules)
    return global_batch(dataset.batch(step, parts[0] if len(parts) == 1 else parts, count), mesh, rules)


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, PartitionSpec())


@contextlib.contextmanager
def activate(mesh: Mesh, rules):
    """Makes `mesh` and `rules` current while tracing, so the model's activation constraints bind."""
    with jax.sharding.set_mesh(mesh), nn.logical_axis_rules(rules):
        yield


def describe(tree) -> dict:
    """{path: PartitionSpec string} of a pytree of sharded arrays, for logs and tests."""
    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {jax.tree_util.keystr(path): str(leaf.sharding.spec) for path, leaf in flat}

