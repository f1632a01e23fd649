"""Defaults, validation and derived values for a run (the rules themselves: maxlm/config/rules.py).

A run's config is an `ml_collections.ConfigDict`. `configs/NAME.py` files start from `defaults()`
and override what they need; command-line `--config.KEY=VALUE` flags override those. Each key is
declared once with its default, domain and description (maxlm/config/schema.py, *_keys.py). `resolve()`
then checks every constraint that needs only the config, the device count and the platform,
*before* anything is compiled or written (those that need the data, a checkpoint or a Hugging Face
folder follow it: docs/config.md#validation), fills the mesh's `-1`, and returns the config that
`DIR/config.json` records.
"""

from __future__ import annotations

import json
import os

import ml_collections

from maxlm.config import mesh_axes, run_keys
from maxlm.config.mesh_axes import DEFAULT_RULES, MESH_AXES  # noqa: F401  (MESH_AXES: config_lib.MESH_AXES)
from maxlm.config.rules import (  # noqa: F401  (the domains and choices, as config_lib.POSITIONS etc.)
    ATTENTION,
    ATTENTION_KINDS,
    BOOL,
    CONTEXT_PARALLEL,
    DTYPES,
    EXPERT_DISPATCH,
    GROUPED_MATMUL,
    INT_OR_OFF,
    LOAD_BALANCE,
    LR_BATCH_SCALING,
    MESH_SIZE,
    MLP_ACTIVATIONS,
    MU_DTYPES,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    NORM_PLACEMENTS,
    NORMS,
    OPTIMIZERS,
    PLATFORMS,
    POSITIONS,
    POSITIVE,
    POSITIVE_INT,
    QK_NORMS,
    REMAT,
    ROPE_SCALINGS,
    ROUTERS,
    SCHEDULES,
    Domain,
    between,
    check_checkpoint,
    check_context_parallel,
    check_data,
    check_eval,
    check_metrics,
    check_model_and_optim,
    check_monitor,
    check_optimizer,
    check_platform,
    check_values,
    one_of,
    resolve_units,
)
from maxlm.config.schema import Assigned, Key, assigned_keys, flatten, unknown_key_message  # noqa: F401
from maxlm.runtime.errors import ConfigError  # noqa: F401  (config_lib.ConfigError)

# Read once: the declarations are constants of the code.
_DECLARED = run_keys.RUN.keys()
_DECLARED_TREE = run_keys.RUN.values()


def declared() -> dict[str, Key]:
    """{dotted name: Key} of every key a run reads, in declaration order (maxlm/config/*_keys.py)."""
    return dict(_DECLARED)


def defaults() -> ml_collections.ConfigDict:
    """Every key a run reads, with its default. Config files override a subset; the keys they and
    the `--config.KEY` flags assign are recorded (`schema.assigned_keys`)."""
    config = Assigned(_DECLARED_TREE)
    config.record()
    return config


def domains() -> dict[str, Domain]:
    """{dotted key: its Domain}, in declaration order: what `resolve` checks first."""
    return {name: k.domain for name, k in _DECLARED.items() if k.domain is not None}


def check_known(c, what: str = "") -> None:
    """ConfigError naming the first key of `c` that no declaration has (a typo in a config file:
    `c.optim.lrr = ...`), with the nearest known key."""
    known = _DECLARED
    for name in flatten(c.to_dict()):
        if name not in known and not any(name.startswith(k + ".") for k in known if _DECLARED[k].type is tuple):
            raise ConfigError(unknown_key_message(name, list(known)) + what)


def load_file(path: str) -> ml_collections.ConfigDict:
    """`get_config()` of the config file at `path`: how a config file builds on another, e.g.
    `load_file(os.path.join(os.path.dirname(__file__), "llama_1b.py"))` in configs/."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(os.path.splitext(os.path.basename(path))[0], path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def resolve(config: ml_collections.ConfigDict, num_devices: int, num_granules: int | None = None,
            platform: str | None = None, flags=()) -> ml_collections.ConfigDict:
    """Validates `config` for `num_devices` and returns a copy with derived values filled in.

    `num_granules`: how many TPU slices (processes on GPU/CPU) the devices come in, checked
    against `mesh.dcn_*` (None: not checked; `mesh.make_mesh` checks it again). `platform`: the
    platform JAX runs on (`jax.default_backend()`), checked against the config's `platform`
    (None: not checked). `flags`: the dotted keys the command line's `--config.KEY` flags set, which
    win over the same choice made in the config file (batch_tokens over the file's batch_size).
    Raises ConfigError with a one-line message on the first problem found: a key no declaration
    has (a typo), a value outside its key's domain or of another type, then the rules between keys.
    """
    assigned = assigned_keys(config)  # what the file and the flags set, before the copy forgets it
    c = ml_collections.ConfigDict(config.to_dict())
    check_known(c)
    check_values(c, domains())
    # batch_tokens, optim.warmup_fraction: before the rules that read batch_size, warmup_steps
    resolve_units(c, defaults(), assigned, frozenset(flags))
    check_monitor(c)
    check_platform(c, num_devices, platform)
    check_model_and_optim(c)
    check_optimizer(c)
    mesh_axes.check_mesh(c, num_devices, num_granules)
    check_context_parallel(c)
    check_data(c)
    check_eval(c)
    check_metrics(c)
    check_checkpoint(c)
    return c



def from_recorded(recorded: dict) -> ml_collections.ConfigDict:
    """A config an earlier run recorded (its `config.json`, a checkpoint's `config` item), with
    every key added to `defaults()` since then filled in with its default: the one place an
    older run's config is read, so no other code needs a fallback for a missing key."""

    def merged(base: dict, over: dict) -> dict:
        out = dict(base)
        for key, value in over.items():
            nested = isinstance(value, dict) and isinstance(base.get(key), dict)
            out[key] = merged(base[key], value) if nested else value
        return out

    config = ml_collections.ConfigDict(merged(defaults().to_dict(), recorded))
    for name, domain in domains().items():  # config.json is JSON: nothing typed it on the way back
        if not domain.test(value := _get(config, name)):
            raise ConfigError(f"the recorded {name}={value!r} is not {domain.what}")
    return config


def _get(c, name: str):
    for part in name.split("."):
        c = c[part]
    return c


def apply_overrides(config: ml_collections.ConfigDict, overrides: dict) -> ml_collections.ConfigDict:
    """Sets dotted keys ("optim.lr") in place, as `--config.optim.lr=...` would; returns `config`."""
    for key, value in overrides.items():
        node = config
        *path, last = key.split(".")
        for part in path:
            node = node[part]
        node[last] = value
    return config


def to_json(config: ml_collections.ConfigDict) -> str:
    return json.dumps(config.to_dict(), indent=2, sort_keys=True)
