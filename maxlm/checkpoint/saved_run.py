"""A training run's workdir, read back: its recorded config and a checkpoint's parameters.

    run = load_run(workdir, step=None)   # {"config", "mesh", "rules", "params", "step", "path"}

What `python -m maxlm.eval`, `maxlm.generate` and `maxlm.export` start from: `DIR/config.json`
(the resolved config the run recorded, through `config.from_recorded`), re-resolved for the
devices here when their count differs from the run's, and one checkpoint's parameters (default the
newest complete one) restored straight into the shards that config's mesh rules give them.
"""

from __future__ import annotations

import json
import math
import os
from typing import Any

import jax
import ml_collections

from maxlm import config as config_lib
from maxlm.checkpoint import store as checkpoint
from maxlm.runtime import paths, processes
from maxlm.runtime.errors import UserError
from maxlm.sharding import mesh as mesh_lib, state as state_lib


class RunError(UserError):
    """A workdir that cannot be used: no config.json, no checkpoint, a bad split (exit 2)."""


def read_config(workdir: str, num_devices: int | None = None) -> ml_collections.ConfigDict:
    """The config `workdir` recorded, resolved for `num_devices` (default: all devices here).

    The recorded mesh is kept when its size is the device count; otherwise it is re-resolved as
    (stage=1, data=1, fsdp=-1, expert=1, sequence=1, tensor=its tensor if that divides the devices,
    else 1), single granule.
    """
    path = paths.workdir_path(workdir) / "config.json"
    if not path.exists():
        raise RunError(f"no config.json in {paths.workdir_path(workdir)} "
                       "(is --workdir a training run's workdir?)")
    try:
        recorded = json.loads(path.read_text())
    except ValueError as e:
        raise RunError(f"{path} is not valid JSON ({e})") from None
    num_devices = jax.device_count() if num_devices is None else num_devices
    cfg = config_lib.from_recorded(recorded)
    cfg.platform, cfg.num_devices = "", 0  # the run is read back wherever this command runs
    if math.prod(int(cfg.mesh[a]) for a in config_lib.MESH_AXES) != num_devices:
        tensor = int(cfg.mesh.tensor)
        cfg.mesh.update(stage=1, data=1, fsdp=-1, expert=1, sequence=1,
                        tensor=tensor if num_devices % tensor == 0 else 1, dcn_data=1, dcn_fsdp=1, dcn_expert=1)
    try:
        return config_lib.resolve(cfg, num_devices, mesh_lib.num_granules())
    except config_lib.ConfigError as e:
        raise RunError(f"the run's config does not fit the {num_devices} devices here: {e}") from None


def checkpoint_path(workdir: str, step: int | None = None) -> str:
    """`DIR/checkpoints/STEP`: the newest complete checkpoint, or the one of `step`. Process 0
    decides and every process gets its answer (a live run's step can commit between two hosts'
    listings): call it on every process of the command."""
    return processes.from_process_0(lambda: _checkpoint_path(workdir, step).encode()).decode()


def _checkpoint_path(workdir: str, step: int | None) -> str:
    directory = checkpoint.checkpoint_dir(workdir)
    complete = checkpoint.complete_steps(directory)
    if not complete:
        raise RunError(f"no complete checkpoint in {directory}")
    if step is None:
        return complete[-1][1]
    for s, p in complete:
        if s == step:
            return p
    steps = ", ".join(str(s) for s, _ in complete)
    raise RunError(f"--step={step}: no complete checkpoint of that step in {directory} (steps: {steps})")


def restore_params(path: str, cfg, mesh, rules):
    """(params, meta) of the checkpoint at `path`, the parameters restored straight into their
    shards."""
    params = state_lib.abstract_params(cfg.model, state_lib.param_shardings(cfg.model, mesh, rules))
    try:
        restored, meta = checkpoint.restore_state(path, {"params": params}, params_only=True)
    except Exception as e:  # noqa: BLE001 - damage or a config that does not match the checkpoint
        raise RunError(f"{path} does not restore with the run's config: {checkpoint.short(e)}") from None
    return restored["params"], meta


def load_run(workdir: str, step: int | None = None) -> dict[str, Any]:
    """{"config", "mesh", "rules", "params", "step", "path"} of a checkpoint of `workdir`."""
    cfg = read_config(workdir)
    path = checkpoint_path(workdir, step)
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh)
    params, meta = restore_params(path, cfg, mesh, rules)
    return {"config": cfg, "mesh": mesh, "rules": rules, "params": params,
            "step": int(meta.get("step", os.path.basename(path))), "path": path}
