"""Orbax wiring: where checkpoints live, when they are written and kept, how a run resumes.

`python -m maxlm.checkpoint {list,verify} DIR` reads them (maxlm/checkpoint/__main__.py).

A checkpoint is `WORKDIR/checkpoints/STEP/` with three orbax items:
  state   the whole train state: step, params, optimizer state, skipped-step counters
  meta    JSON: step, seed (the model has no dropout, so the seed is all the RNG there is), data
          position (the step plus the batches skipped after loss spikes: maxlm/resilience/anomaly.py,
          so a step's batch is a pure function of the config, the step and the skips), lr scale,
          kind (regular / temporary / preemption / final), wall time, mesh, process count
  config  the resolved config as JSON
Saves are async: `save()` blocks only while the device arrays are copied to host memory, the write
happens in a background thread, and the next save first waits for the previous one to commit.
Orbax writes into `STEP.orbax-checkpoint-tmp` and renames it when complete, so an interrupted save
is never mistaken for a checkpoint. On resume every candidate is checked (metadata readable, all
items present, arrays readable, values finite); a damaged one is marked by a file `STEP.damaged`
beside it (one small write, where a rename would copy the whole tree on Cloud Storage) with a
one-line warning, and the previous one is used. It stays until the run saves that step again.
A save that storage refuses (a full disk, no permission, a bucket that says no) ends the run with
`StorageError`: one line naming the step, why, where and the last good checkpoint.

With `checkpoint.local_dir`, saves of kind "local" go to the host-local tier instead
(maxlm/checkpoint/local_tier.py), and `restore_latest` takes a local step when it is at least as new
as the newest persistent one.

Retention (done here, not by orbax, so that its rules are ours): the newest `max_to_keep` regular
checkpoints, every step that is a multiple of `keep_period` forever, a time-based (temporary)
checkpoint only until a newer one has committed, and never the newest committed checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import functools
import json
import logging
import os
import re
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

from maxlm.checkpoint import local_tier
from maxlm.optim import loss_scale
from maxlm.resilience import faults
from maxlm.runtime import console, paths, processes
from maxlm.runtime.errors import ConfigError
from maxlm.sharding import state as state_lib

log = logging.getLogger("maxlm")

ITEMS = ("state", "meta", "config")
# State entries a checkpoint may lack or hold beyond the restore target: the dynamic loss scale
# exists only in float16 runs (and not in checkpoints written before it did). See restore_state.
OPTIONAL_STATE = frozenset(loss_scale.STATE_KEYS)
TMP_SUFFIX = ".orbax-checkpoint-tmp"
DAMAGED_SUFFIX = ".damaged"  # STEP.damaged: a file marking the directory STEP as damaged (older runs: a renamed directory)
finite_state = jax.jit(state_lib.all_finite)


class _NoItemMetadataWarning(logging.Filter):
    """Drops orbax's warning `Metadata file does not exist: STEP/ITEM/_CHECKPOINT_METADATA`.
    Orbax writes that file for the step (`STEP/_CHECKPOINT_METADATA`, which `file_problem`
    checks), never inside an item, yet a PyTreeCheckpointer reading the item `STEP/state` looks
    for one there and warns at each read of a resume: a line that reads like damage where nothing
    is wrong. The same warning about any other file still shows."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg != "Metadata file does not exist: %s" or not record.args:
            return True
        path = epath.Path(str(record.args[0]))
        return not (path.name == "_CHECKPOINT_METADATA" and path.parent.name in ITEMS)


logging.getLogger("absl").addFilter(_NoItemMetadataWarning())  # orbax logs through absl's logger


def checkpoint_dir(workdir: str) -> str:
    """WORKDIR/checkpoints: absolute for a local workdir, the URL itself for gs:// and the like."""
    return os.fspath(paths.workdir_path(workdir) / "checkpoints")


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class StorageError(Exception):
    """A checkpoint could not be written (no space, no permission, the bucket refused): the
    message is the one line the run ends with."""


def agreed_steps(steps) -> list[int]:
    """Process 0's list of `steps` on every process. Each process lists the directory itself; a
    stale listing on one would have it run another number of collectives (one per step checked)
    than the others, and the job would hang."""
    steps = sorted(int(s) for s in steps)
    if jax.process_count() == 1:
        return steps
    count = int(processes.broadcast(np.array([len(steps)], np.int64))[0])
    padded = np.zeros(count, np.int64)
    padded[:min(count, len(steps))] = steps[:count]
    return [int(s) for s in processes.broadcast(padded)] if count else []


def agreed(problem: str | None, what: str) -> str | None:
    """One verdict on `what` (a checkpoint) for every process, from each one's own `problem` (None:
    fine): damaged if any process found it so. Each process reads its own view of the files;
    deciding alone, one would quarantine a checkpoint and wait at a barrier while the others
    restored it in a collective, and the job would hang."""
    if jax.process_count() == 1:
        return problem
    from jax.experimental import multihost_utils

    if problem is not None:
        log.warning("process %d: %s: %s", jax.process_index(), what, problem)
    seen = np.asarray(multihost_utils.process_allgather(np.int32(problem is not None)))
    if problem is None and seen.any():
        problem = f"damaged as process {int(np.flatnonzero(seen)[0])} reads it"
    return problem


# ----------------------------------------------------------------------------- integrity


def step_dirs(directory: str) -> dict[str, list]:
    """{"complete": [(step, path)], "incomplete": [...], "damaged": [...]} sorted by step."""
    found: dict[str, list] = {"complete": [], "incomplete": [], "damaged": []}
    if not epath.Path(directory).is_dir():
        return found
    entries = list(epath.Path(directory).iterdir())
    marked = {e.name[:-len(DAMAGED_SUFFIX)] for e in entries if e.name.endswith(DAMAGED_SUFFIX) and not e.is_dir()}
    for entry in entries:
        name, path = entry.name, os.fspath(entry)
        if not entry.is_dir():
            continue
        if name.isdigit() and name in marked:
            found["damaged"].append((int(name), path))
        elif name.isdigit():
            found["complete"].append((int(name), path))
        elif (m := re.fullmatch(r"(\d+)" + re.escape(TMP_SUFFIX) + r".*", name)):
            found["incomplete"].append((int(m.group(1)), path))
        elif (m := re.fullmatch(r"(\d+)" + re.escape(DAMAGED_SUFFIX) + r".*", name)):
            found["damaged"].append((int(m.group(1)), path))
    return {k: sorted(v) for k, v in found.items()}


def file_problem(path: str) -> str | None:
    """Why the checkpoint at `path` is damaged judging by its files alone, or None."""
    path = epath.Path(path)  # local, or gs:// and the like
    try:
        json.loads((path / "_CHECKPOINT_METADATA").read_text())
    except (OSError, ValueError) as e:
        return f"unreadable _CHECKPOINT_METADATA ({type(e).__name__})"
    for item in ITEMS:
        if not (path / item).is_dir():
            return f"item {item!r} missing"
    for item in ("meta", "config"):
        try:
            json.loads((path / item / "metadata").read_text())
        except (OSError, ValueError) as e:
            return f"unreadable {item}/metadata ({type(e).__name__})"
    for name in ("manifest.ocdbt", "_sharding"):
        if not (path / "state" / name).exists():
            return f"state/{name} missing"
    return None


def _recorded_kind(path: str) -> str | None:
    """The kind a checkpoint's meta records (regular, temporary, preemption, final), or None."""
    try:
        return read_json(path, "meta").get("kind")
    except (OSError, ValueError):
        return None


# Storage's refusals, by their codes, never by words a path could hold (`gs://b/exp403/`):
_ERRNO_REFUSALS = {errno.ENOSPC: "no space left on device", errno.EDQUOT: "disk quota exceeded",
                   errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
                   errno.EPERM: "permission denied"}
# tensorstore's errors (orbax's array writes) are absl statuses, their text `CODE: message`, an OS
# error's number in it as `[os_error_code='28']`
_STATUS_REFUSALS = {"RESOURCE_EXHAUSTED": "storage is out of space (RESOURCE_EXHAUSTED)",
                    "PERMISSION_DENIED": "permission denied"}
FORBIDDEN = "the bucket refused the write (403 Forbidden)"


def storage_problem(e: BaseException) -> str | None:
    """What storage said in `e` (or the errors it was raised from) when it refused a write, in a
    few words, or None if `e` is not such a refusal. Read from codes only: an OSError's errno
    (its strerror for the others), an HTTP status 403 (gcsfs's HttpError, whose 403 reaches
    callers as its `OSError("Forbidden: ...")`), a tensorstore status code."""
    while e is not None:
        if isinstance(e, OSError):
            if e.errno in _ERRNO_REFUSALS:
                return _ERRNO_REFUSALS[e.errno]
            if e.errno is None and type(e) is OSError and str(e).startswith("Forbidden: "):
                return FORBIDDEN  # gcsfs.retry.validate_response's 403
            if e.strerror:
                return e.strerror.lower()
        if getattr(e, "code", None) == 403:  # an HTTP error object (gcsfs, google-api-core)
            return FORBIDDEN
        status = re.match(r"([A-Z_]+): ", str(e))
        if status and status[1] in _STATUS_REFUSALS:
            os_error = re.search(r"\[os_error_code='(\d+)'\]", str(e))
            return _ERRNO_REFUSALS.get(int(os_error[1]) if os_error else None) or _STATUS_REFUSALS[status[1]]
        e = e.__cause__ or e.__context__
    return None


def short(e: Exception) -> str:
    """An exception as one short line, for messages."""
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text[:160]}"


def read_json(path: str, item: str) -> dict:
    return json.loads((epath.Path(path) / item / "metadata").read_text())


# ----------------------------------------------------------------------------- the manager


class Checkpointer:
    """An orbax CheckpointManager plus our retention rules, integrity checks and resume."""

    def __init__(self, workdir: str, checkpoint_cfg):
        self.directory = checkpoint_dir(workdir)
        self.cfg = checkpoint_cfg
        epath.Path(self.directory).mkdir(parents=True, exist_ok=True)
        found = step_dirs(self.directory)
        for step, path in found["incomplete"]:
            console.warn(f"ignoring incomplete checkpoint {path} (interrupted write; removed)")
        self.damaged = {step for step, path in found["damaged"] if os.path.basename(path).isdigit()}
        listed = dict(found["complete"])
        good = []
        for step in agreed_steps(listed):  # checked before orbax reads (and logs about) them
            path = os.path.join(self.directory, str(step))
            if (problem := agreed(file_problem(path), path)) is not None:
                self._quarantine(path, problem)
            else:
                good.append((step, path))
        _sync("maxlm_checkpoint_scan")
        # time-based saves, each replaced by the next committed one; one stays temporary across
        # restarts: its kind is in its meta
        self.temporary: set[int] = {step for step, path in good if _recorded_kind(path) == "temporary"}
        self.writing: int | None = None  # the step of the save in flight
        self.failed = False
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None,  # retention is ours: see prune()
            enable_async_checkpointing=True,  # training continues while the write happens
            cleanup_tmp_directories=True,  # interrupted writes (named in the warning above)
            create=True,
        )
        self.manager = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)
        # the host-local tier (checkpoint.local_dir): frequent saves to each host's own disk
        self.local = local_tier.LocalTier(checkpoint_cfg, workdir) if checkpoint_cfg.local_dir else None
        self.restored_from = ""  # where restore_latest found the state it returned

    def _quarantine(self, path: str, problem: str) -> None:
        """Marks the checkpoint at `path` damaged: a file beside it, written by process 0."""
        console.warn(f"skipping damaged checkpoint {path}: {problem}; marked {path}{DAMAGED_SUFFIX}")
        if jax.process_index() == 0:
            epath.Path(path + DAMAGED_SUFFIX).write_text(problem + "\n")
        self.damaged.add(int(os.path.basename(path)))

    def steps(self) -> list[int]:
        """The committed checkpoints' steps, the damaged ones left out."""
        return sorted(s for s in self.manager.all_steps() if s not in self.damaged)

    # -- saving

    def save(self, step: int, state, meta: dict, config_dict: dict, kind: str = "regular") -> None:
        """Starts an async save; returns once the arrays are on the host (the write continues).

        The previous save is waited for first (it must commit before retention may drop older
        checkpoints), then retention runs. Raises StorageError when storage refuses the write (or
        cannot hold it), having removed the partial directory; no good checkpoint is touched.
        """
        if kind == "local":
            return self._save_local(step, state, meta, config_dict)
        self.wait()
        self.prune()
        if step in self.steps():  # e.g. the final step, already saved
            return
        # The step skips non-finite updates and the fault policy postpones saves inside a streak of
        # them, so this never fires in a healthy run; it makes "no non-finite state is ever saved"
        # hold whatever went wrong, for one on-device pass over the state (the save then copies all
        # of it to the host anyway).
        if not bool(finite_state(state)):
            raise faults.NonFiniteLossError(f"the state of step {step} holds non-finite values: not saved "
                                            f"(the checkpoints in {self.directory} are untouched)")
        if step in self.damaged:
            self._replace_damaged(step)
        # Refusals found before orbax starts are one clean line; inside its background write they
        # come with orbax's own tracebacks (and are still turned into StorageError below).
        needed, free = self._needed_bytes(state), paths.free_bytes(self.directory)
        refused = self._write_problem() if jax.process_index() == 0 else None
        if refused is None and free is not None and free < needed:
            refused = "not enough free space"
        if (refused := agreed(refused, self.directory)) is not None:
            raise StorageError(self._failure(step, refused, needed, free))
        meta = dict({"data_position": step}, **meta, step=step, kind=kind,
                    saved_at=datetime.datetime.now().isoformat(timespec="seconds"))
        self.writing = step
        with self._storage_errors():
            self.manager.save(
                step,
                args=ocp.args.Composite(
                    state=ocp.args.StandardSave(state),
                    meta=ocp.args.JsonSave(meta),
                    config=ocp.args.JsonSave(config_dict),
                ),
                force=True,
            )
        if kind == "temporary":
            self.temporary.add(step)

    def _save_local(self, step: int, state, meta: dict, config_dict: dict) -> None:
        if not bool(finite_state(state)):  # as for the persistent tier: never a non-finite state
            raise faults.NonFiniteLossError(f"the state of step {step} holds non-finite values: not saved "
                                            f"(the checkpoints in {self.local.root} are untouched)")
        meta = dict({"data_position": step}, **meta, saved_at=datetime.datetime.now().isoformat(timespec="seconds"))
        self.local.save(step, state, meta, config_dict)

    def _replace_damaged(self, step: int) -> None:
        """The run saves a step whose checkpoint was marked damaged: that one goes (it has been
        skipped since it was marked; the good state of the step replaces it)."""
        path = os.path.join(self.directory, str(step))
        console.warn(f"replacing damaged checkpoint {path} with the new save of step {step}")
        self.manager.delete(step)  # on every process: orbax syncs them
        if jax.process_index() == 0:
            epath.Path(path + DAMAGED_SUFFIX).unlink(missing_ok=True)
        _sync(f"maxlm_checkpoint_replace_{step}")
        self.manager.reload()
        self.damaged.discard(step)

    def _write_problem(self) -> str | None:
        """Why storage refuses a write in the checkpoint directory (a small probe file), or None."""
        probe = epath.Path(self.directory) / ".maxlm-write-probe"
        try:
            probe.write_text("maxlm\n")
            probe.unlink()
        except Exception as e:  # noqa: BLE001 - whatever storage answers, said in one line
            return storage_problem(e) or short(e)
        return None

    def _needed_bytes(self, state) -> int:
        """About what a checkpoint takes: the newest one's size, else the state's bytes."""
        steps = self.steps()
        if steps and not paths.is_remote(self.directory):
            return self._bytes_of(steps[-1])
        return sum(x.nbytes for x in jax.tree.leaves(state))

    @functools.lru_cache(maxsize=1)  # noqa: B019 - one figure per newest step: a listing, not one per save
    def _bytes_of(self, step: int) -> int:
        return paths.tree_bytes(os.path.join(self.directory, str(step)))

    def warn_if_short_of_space(self, state_bytes: int) -> None:
        """At start: a warning when the checkpoint directory cannot hold `max_to_keep` + 1
        checkpoints (retention deletes an old one only after the new one has committed)."""
        free = paths.free_bytes(self.directory)
        if free is None:
            return
        steps = self.steps()
        size = self._bytes_of(steps[-1]) if steps else state_bytes
        held = min(len(steps), self.cfg.max_to_keep)  # already on disk, and kept
        wanted = (self.cfg.max_to_keep + 1 - held) * size
        if free < wanted:
            console.warn(f"{self.directory} has {paths.human_bytes(free)} free, less than the "
                         f"{paths.human_bytes(wanted)} that checkpoint.max_to_keep={self.cfg.max_to_keep} "
                         f"checkpoints of about {paths.human_bytes(size)} (+1 being written) need: a save will fail")

    @contextlib.contextmanager
    def _storage_errors(self):
        """Turns storage's refusal of the save in flight into a StorageError."""
        try:
            yield
        except Exception as e:
            why = storage_problem(e)
            if why is None or self.writing is None:
                raise
            step, self.writing, self.failed = self.writing, None, True
            self._remove_partial(step)
            raise StorageError(self._failure(step, why, None, paths.free_bytes(self.directory))) from e

    def _remove_partial(self, step: int) -> None:
        if jax.process_index() != 0:
            return
        for entry in epath.Path(self.directory).iterdir():
            if re.fullmatch(rf"{step}{re.escape(TMP_SUFFIX)}.*", entry.name):
                entry.rmtree(missing_ok=True) if entry.is_dir() else entry.unlink(missing_ok=True)

    def _failure(self, step: int, why: str, needed: int | None, free: int | None) -> str:
        space = "space" in why or "quota" in why
        sizes = ""
        if space and free is not None:
            sizes = f" ({paths.human_bytes(free)} free)" if needed is None else \
                f" (it needs about {paths.human_bytes(needed)}, {paths.human_bytes(free)} free)"
        good = [s for s in self.steps() if s != step]
        last = f"step {good[-1]}" if good else "none"
        fix = "make room (or lower checkpoint.max_to_keep)" if space else "let the run write there"
        return (f"could not write the checkpoint of step {step} to {self.directory}: {why}{sizes}; "
                f"the last good checkpoint is {last}: {fix} and rerun the same command to resume")

    def wait(self) -> None:
        if self.local is not None:
            self.local.wait()
        with self._storage_errors():
            self.manager.wait_until_finished()
        self.writing = None

    def prune(self) -> None:
        """Applies retention to the committed checkpoints (call only when no save is pending)."""
        committed = self.steps()
        if not committed:
            return
        regular = [s for s in committed if s not in self.temporary]
        keep = set(regular[-self.cfg.max_to_keep:]) | {committed[-1]}
        if self.cfg.keep_period:
            keep |= {s for s in committed if s % self.cfg.keep_period == 0}
        for step in committed:
            if step not in keep:
                self.manager.delete(step)
                self.temporary.discard(step)

    def close(self) -> None:
        if self.failed:  # the write failed: its error is on its way out already; orbax's would repeat it
            return
        self.wait()
        self.prune()
        if self.local is not None:
            self.local.close()
        self.manager.close()

    # -- restoring

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def restore_latest(self, abstract_state, before: int | None = None) -> tuple[Any, dict] | None:
        """(state, meta) of the newest checkpoint that restores and is finite, or None; with
        `before`, the newest of those with a step below it.

        `abstract_state` holds jax.ShapeDtypeStructs with shardings, so a checkpoint written on
        one mesh (or device or process count) lands directly, resharded, on the current one.
        Damaged checkpoints are marked with a warning, not deleted. The steps are process 0's
        listing and every verdict is agreed by all processes (`agreed`), so they restore the same
        checkpoint.
        """
        self.manager.reload()
        steps = [s for s in agreed_steps(self.steps()) if before is None or s < before]
        if self.local is not None:  # a local step at least as new as the persistent tier's newest
            back = self.local.restore(abstract_state, self._agreed_content, below=before, at_least=steps[-1] if steps else 0)
            if back is not None:
                self.restored_from = f"the local tier {self.local.root}"
                return back
        for step in reversed(steps):
            path = os.path.join(self.directory, str(step))
            problem = agreed(file_problem(path), path)
            if problem is None:  # readable: a checkpoint that does not fit the run is not damage
                misfit = agreed(shape_problem(path, abstract_state), path)
                if misfit is not None:
                    raise ConfigError(f"the checkpoint {path} does not fit this run: {misfit}; nothing was "
                                      "changed (resume with the checkpoint's config, or use another workdir)")
                try:
                    restored = restore_state(path, abstract_state)
                    problem = _content_problem(restored[0], step)
                except Exception as e:  # noqa: BLE001 - any failure to read is damage
                    problem = f"does not restore ({short(e)})"
                problem = agreed(problem, path)
            if problem is None:
                self.restored_from = self.directory
                return restored
            _sync(f"maxlm_checkpoint_check_{step}")
            self._quarantine(path, problem)
            _sync(f"maxlm_checkpoint_quarantine_{step}")
            self.manager.reload()
        return None


    @staticmethod
    def _agreed_content(state, step: int) -> str | None:
        return agreed(_content_problem(state, step), f"step {step}")

    def discard_after(self, step: int) -> None:
        """Deletes the checkpoints newer than `step`: after a loss-spike rollback to `step` they
        hold states from within the spike, and the steps they hold are trained again."""
        self.wait()
        if self.local is not None:
            self.local.prune(newer_than=step)
        self.manager.reload()
        for newer in [s for s in self.steps() if s > step]:
            console.warn(f"removing checkpoint {os.path.join(self.directory, str(newer))}: written after "
                     "the loss spike began")
            self.manager.delete(newer)
            self.temporary.discard(newer)


def _content_problem(state, step: int) -> str | None:
    """Why a restored state cannot be the checkpoint of `step`, or None."""
    if int(state["step"]) != step:
        return f"holds step {int(state['step'])}"
    if not bool(finite_state(state)):
        return "holds non-finite values"
    return None


def restore_state(path: str, abstract_state, params_only: bool = False):
    """(state, meta) of the checkpoint directory `path` (`.../checkpoints/STEP`).

    Only the OPTIONAL_STATE entries (the loss scale) may differ from `abstract_state`: those the
    checkpoint lacks are missing from the state returned (the caller keeps its own, see
    `state.with_missing_from`), those the target lacks are not read. Any other difference fails.
    """
    handler = ocp.PyTreeCheckpointer()
    directory = os.path.join(path, "state")
    target, partial = {"params": abstract_state["params"]}, True
    if not params_only:
        saved = set(saved_tree(handler, directory))
        target = {k: v for k, v in abstract_state.items() if k in saved or k not in OPTIONAL_STATE}
        extra = saved - set(target)
        partial = bool(extra) and extra <= OPTIONAL_STATE
    restore_args = ocp.checkpoint_utils.construct_restore_args(target)
    state = handler.restore(
        directory, args=ocp.args.PyTreeRestore(target, restore_args=restore_args, partial_restore=partial)
    )
    return state, read_json(path, "meta")


def saved_tree(handler, directory: str):
    """The saved pytree's metadata (its leaves describe the arrays)."""
    saved = handler.metadata(directory)
    return saved.item_metadata.tree if hasattr(saved, "item_metadata") else saved.tree


def complete_steps(directory: str) -> list[tuple[int, str]]:
    """[(step, path)] of the checkpoints in `directory` that are complete by their files, by step."""
    return [(s, p) for s, p in step_dirs(directory)["complete"] if file_problem(p) is None]


def resolve_restore_from(path: str) -> str:
    """A checkpoint step directory from PATH: a step dir, a `checkpoints/` dir or a workdir (its
    newest complete step). Process 0 resolves it and every process gets its answer, so all restore
    the same step even where one commits between two hosts' listings: call it on every process."""
    return processes.from_process_0(lambda: _resolve_restore_from(path).encode()).decode()


def _resolve_restore_from(path: str) -> str:
    path = path if paths.is_remote(path) else os.path.abspath(os.path.expanduser(path))
    if epath.Path(path, "state").is_dir():
        return path
    for candidate in (os.path.join(path, "checkpoints"), path):
        steps = complete_steps(candidate)
        if steps:
            return steps[-1][1]
    raise ValueError(f"checkpoint.restore_from={path} holds no complete checkpoint")


def shapes_by_path(tree) -> dict[tuple[str, ...], tuple[int, ...]]:
    """{path: shape} of a pytree's leaves, a path being the names of its keys, indices and fields
    alike: orbax's metadata holds optax's namedtuples (Adam's, Adafactor's states) as dicts of
    their fields, sorted by name, and its tuples as lists."""
    def name(key) -> str:
        return str(getattr(key, "key", getattr(key, "idx", getattr(key, "name", key))))

    flat, _ = jax.tree_util.tree_flatten_with_path(tree)
    return {tuple(name(k) for k in path): tuple(leaf.shape) for path, leaf in flat}

def shape_problem(path: str, abstract_state, params_only: bool = False) -> str | None:
    """Why the arrays saved at `path` cannot be restored into `abstract_state` (another tree or
    other shapes), or None; only the parameters with `params_only`. Reads metadata, no arrays."""
    saved = shapes_by_path(saved_tree(ocp.PyTreeCheckpointer(), os.path.join(path, "state")))
    wanted = shapes_by_path(abstract_state)
    keep = (lambda k: k[0] == "params") if params_only else (lambda k: k[0] not in OPTIONAL_STATE)
    saved, wanted = ({k: v for k, v in d.items() if keep(k)} for d in (saved, wanted))
    if saved == wanted:
        return None
    differ = sorted(set(saved.items()) ^ set(wanted.items()))
    first = differ[0][0]
    return (f"{len(saved)} arrays saved, {len(wanted)} expected; first difference at {'/'.join(first)}: "
            f"saved {saved.get(first, 'nothing')}, expected {wanted.get(first, 'nothing')}")
