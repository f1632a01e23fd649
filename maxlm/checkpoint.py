"""Orbax wiring: where checkpoints live, when they are written, how a run resumes.

A checkpoint is the whole TrainState (step, params, optimizer state) in `WORKDIR/checkpoints/STEP/`
plus the resolved config as JSON beside it. The data position needs no saving: the batch of step
`s` is a pure function of (config, s), so the restored step *is* the data position.
Orbax writes each step into a temporary directory and renames it when complete, so an interrupted
save is never mistaken for a checkpoint.
"""

from __future__ import annotations

import os

import orbax.checkpoint as ocp


def checkpoint_dir(workdir: str) -> str:
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def open_manager(workdir: str, checkpoint_cfg) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=checkpoint_cfg.max_to_keep,
        enable_async_checkpointing=True,  # training continues while the write happens
        create=True,
    )
    return ocp.CheckpointManager(
        checkpoint_dir(workdir), options=options, item_names=("state", "config")
    )


def save(manager: ocp.CheckpointManager, step: int, state: dict, config_dict: dict) -> None:
    """Starts an async save of `state` at `step` (returns once the device arrays are copied)."""
    manager.save(
        step,
        args=ocp.args.Composite(
            state=ocp.args.StandardSave(state), config=ocp.args.JsonSave(config_dict)
        ),
        force=True,
    )


def restore_latest(manager: ocp.CheckpointManager, abstract_state: dict):
    """The newest complete checkpoint restored onto `abstract_state`'s shardings, or None.

    `abstract_state` holds jax.ShapeDtypeStructs with shardings, so a checkpoint written on one
    mesh lands directly, resharded, on the current one.
    """
    step = manager.latest_step()
    if step is None:
        return None
    restored = manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(abstract_state))
    )
    return restored.state
