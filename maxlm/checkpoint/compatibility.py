"""Whether a checkpoint fits a config: the checks made before a run starts from one (`start_problem`)
and those of `python -m maxlm.checkpoint verify` (`verify_one`). They read the checkpoint's recorded
config and its arrays' metadata; only `verify_one` restores the arrays.
"""

from __future__ import annotations

import os

import jax

from maxlm import config as config_lib
from maxlm.checkpoint.store import file_problem, finite_state, read_json, restore_state, shape_problem, short
from maxlm.observe import metrics
from maxlm.optim import optimizers as optim
from maxlm.sharding import state as state_lib


def expected_state(config_dict: dict):
    """The state's ShapeDtypeStructs (on one device) for a recorded config: what a checkpoint of
    it must hold, and the target to restore it into."""
    cfg = config_lib.from_recorded(config_dict)
    tx = optim.make_optimizer(cfg)
    return state_lib.abstract_state(cfg, tx, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


def _positions(model_cfg) -> str:
    table = f", model.max_positions={model_cfg.max_positions}" if model_cfg.positions == "learned" else ""
    return f"model.positions={model_cfg.positions!r}{table}"


def config_changes(saved: dict, now: dict) -> list[str]:
    """`KEY=NOW (checkpoint: SAVED)` for each config key whose value differs, those that shape the
    state (`model.*`, `optim.*`) alone when there are any."""
    a, b = metrics.flatten_config(saved), metrics.flatten_config(now)  # tuples and lists alike, as JSON
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shaping = [k for k in changed if k.startswith(("model.", "optim."))]
    return [f"{k}={b.get(k)!r} (checkpoint: {a.get(k)!r})" for k in (shaping or changed)]


def start_problem(path: str, cfg, full_state: bool) -> str | None:
    """Why `cfg` cannot start from the checkpoint at `path`, or None: its parameters were written
    with another position encoding or learned table length; for a `full_state`, its optimizer
    state by another `optim.name`; or its arrays have other shapes (another model size), named by
    the config keys that differ from the checkpoint's recorded config. Restoring regardless would
    fail, and such a checkpoint is not damaged."""
    saved = config_lib.from_recorded(read_json(path, "config"))
    if _positions(saved.model) != _positions(cfg.model):
        return (f"{_positions(cfg.model)}, but the checkpoint {path} was written with {_positions(saved.model)}: "
                "its parameters do not fit; resume with its settings or start another workdir")
    if full_state and saved.optim.name != cfg.optim.name:
        return (f"optim.name={cfg.optim.name!r}, but the checkpoint {path} holds {saved.optim.name!r} optimizer "
                f"state: resume with optim.name={saved.optim.name!r}, or start a new workdir from its "
                f"parameters (checkpoint.restore_from={path} checkpoint.restore_params_only=True)")
    if (misfit := shape_problem(path, expected_state(cfg.to_dict()), params_only=not full_state)) is not None:
        changes = config_changes(saved.to_dict(), cfg.to_dict())
        return (f"the checkpoint {path} does not fit this config ({misfit}); the config differs from the "
                f"checkpoint's in {', '.join(changes) or 'no key'}. Resume with the checkpoint's settings, or "
                "start another workdir (checkpoint.restore_from with checkpoint.restore_params_only=True keeps "
                "the parameters when only the optimizer changed)")
    return None


def verify_one(path: str, config_dict: dict | None = None) -> str | None:
    """None if the checkpoint at `path` is complete, restores, is finite and has the shapes of
    its config (or of `config_dict`); else what is wrong."""
    if (problem := file_problem(path)) is not None:
        return problem
    try:
        expected = expected_state(config_dict or read_json(path, "config"))
        if (misfit := shape_problem(path, expected)) is not None:
            return f"shapes differ from the config ({misfit})"
        state, meta = restore_state(path, expected)
    except Exception as e:  # noqa: BLE001
        return f"does not restore ({short(e)})"
    if not bool(finite_state(state)):
        return "holds non-finite values"
    if int(state["step"]) != int(os.path.basename(path)) or meta.get("step") != int(state["step"]):
        return f"step mismatch (state {int(state['step'])}, meta {meta.get('step')})"
    return None
