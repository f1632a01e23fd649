"""Metric writers and the metrics.jsonl reader.

Metric writers share one small protocol (`MetricWriter`: write, write_hparams, flush, close) so
the training loop never knows whether it is writing JSONL, TensorBoard, both, or nothing
(non-primary hosts). Rows use flat names (`loss`, `eval_loss`, `tokens_per_sec`, ...), the
contract of metrics.jsonl; the TensorBoard writer files them under groups (`TENSORBOARD_TAGS`).
`read_metrics` reads a metrics.jsonl back (plots, sweeps, tests).
"""

from __future__ import annotations

import json
import math
import os
import secrets
import string
import sys
from collections.abc import Iterable, Mapping
from typing import Any, Protocol, runtime_checkable

import numpy as np

from maxlm.runtime import console, paths, processes
from maxlm.runtime.errors import UserError

# ---------------------------------------------------------------------------
# Metric writers
# ---------------------------------------------------------------------------


@runtime_checkable
class MetricWriter(Protocol):
    """Where metric rows go. A new sink (W&B, MLflow, a database) implements these four methods
    and is added to `make_writers`' list; the loop calls them on every process, and only process
    0 gets real writers (the others get a NullWriter).

    write(step, metrics): one row of scalars under flat names (`loss`, `eval_loss`, ...).
    write_hparams(hparams): the run's flattened, resolved config ({"optim.lr": 3e-4, ...}; values
        bool, int, float or str), once at the start.
    flush(): make what was written durable; close(): flush and release.
    """

    def write(self, step: int, metrics: Mapping[str, float]) -> None: ...
    def write_hparams(self, hparams: Mapping[str, bool | int | float | str]) -> None: ...
    def flush(self) -> None: ...
    def close(self) -> None: ...


# metrics.jsonl's flat names -> TensorBoard tags, grouped by prefix (one TensorBoard section
# each). A name not listed here keeps its name as its tag.
TENSORBOARD_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "clipped_grad_norm": "train/clipped_grad_norm",
    "clipped_fraction": "train/clipped_fraction",
    "param_norm": "train/param_norm",
    "update_ratio": "train/update_ratio",
    "skipped_steps": "train/skipped_steps",
    "bad_streak": "train/bad_streak",
    "spikes": "train/spikes",
    "rollbacks": "train/rollbacks",
    "loss_scale": "train/loss_scale",
    "overflow_steps": "train/overflow_steps",
    "moe_aux_loss": "moe/aux_loss",
    "moe_z_loss": "moe/z_loss",
    "moe_load_max": "moe/load_max",
    "moe_dropped": "moe/dropped",
    "moe_bias_spread": "moe/bias_spread",
    "mtp_loss": "mtp/loss",  # and each depth's mtp/loss_k, named so in metrics.jsonl too
    "eval_loss": "eval/loss",
    "eval_perplexity": "eval/perplexity",
    "tokens_per_sec": "perf/tokens_per_sec",
    "step_time_sec": "perf/step_time_sec",
    "mfu": "perf/mfu",
    "compile_sec": "perf/compile_sec",
    "goodput": "goodput/goodput",  # its badput/<category> names keep their own, in the badput section
    "lost_steps": "goodput/lost_steps",
    "memory_bytes_in_use": "memory/bytes_in_use",
    "memory_peak_bytes_in_use": "memory/peak_bytes_in_use",
    "memory_peak_fraction": "memory/peak_fraction",
}  # monitor/<name>_out_of_range (maxlm/observe/monitor.py) keep their names, in the monitor section


# the eval's loss by position bucket (maxlm/eval/during_training.py): one scalar per bucket, named
# LOSS_BY_POSITION/START by its first position in the document
LOSS_BY_POSITION = "eval/loss_by_position"


def tensorboard_tag(name: str) -> str:
    return TENSORBOARD_TAGS.get(name, name)


def flatten_config(config: Mapping[str, Any], prefix: str = "") -> dict[str, bool | int | float | str]:
    """{"optim": {"lr": 3e-4}, ...} -> {"optim.lr": 3e-4, ...}; values that are not a bool, int,
    float or str (tuples such as mesh.rules, None) become their JSON text."""
    flat: dict[str, bool | int | float | str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten_config(value, name + "."))
        elif isinstance(value, (bool, int, float, str)):
            flat[name] = value
        else:
            flat[name] = json.dumps(value)
    return flat


def _to_python_scalar(name: str, value) -> bool | int | float:
    """numpy/jax/python scalar -> plain Python bool, int or float."""
    arr = np.asarray(value)  # pulls jax arrays to host
    if arr.size != 1:
        raise ValueError(f"metric {name!r} is not a scalar (shape {arr.shape})")
    if arr.dtype.kind in "biu":
        return arr.item()
    return float(arr.reshape(()))  # float(), not .item(): bfloat16 items stay bf16


def _json_value(value: bool | int | float) -> bool | int | float | str:
    # Strict JSON has no NaN/Infinity; Python's json would emit bare NaN, which
    # jq and most non-Python parsers reject. Strings parse everywhere and
    # float("nan"), float("inf"), float("-inf") turn them back into numbers.
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class JsonlWriter:
    """One JSON object per line: {"step": step, **metrics}.

    Opens in append mode so a resumed run continues the same file; a resume
    from an earlier checkpoint therefore repeats some steps, and readers should
    keep the last record for each step. Non-finite floats are written as the
    strings "nan", "inf", "-inf" (see _json_value). Each write is flushed to
    the OS so a crash loses at most the line being written. A remote path
    (gs://...) is appended to at most every paths.REMOTE_FLUSH_SECONDS and on
    close (see paths.AppendFile).
    """

    def __init__(self, path: str | os.PathLike):
        self._file = paths.AppendFile(path)
        if self._file.tail() not in (b"", b"\n"):  # killed mid-write: start on a fresh line
            self._file.write("\n")

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if "step" in metrics:
            raise ValueError("'step' is reserved for the step number")
        record = {"step": int(step)}
        for name, value in metrics.items():
            record[name] = _json_value(_to_python_scalar(name, value))
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()

    def write_hparams(self, hparams: Mapping[str, bool | int | float | str]) -> None:
        pass  # config.json already holds the resolved config

    def flush(self) -> None:
        self._file.flush(force=True)

    def close(self) -> None:
        self._file.close()


class TensorBoardWriter:
    """Scalars to TensorBoard event files via tensorboardX (no TensorFlow).

    Each flat name is written under its group's tag (`TENSORBOARD_TAGS`: `loss` -> `train/loss`,
    `eval_loss` -> `eval/loss`, `mfu` -> `perf/mfu`, ...). Hyperparameters go to the HParams
    dashboard as the hparams plugin's experiment and session-start summaries, in the same run.
    A remote logdir (gs://...) is written through epath (paths.AppendFile), not tensorboardX's
    own gs:// / s3:// writers (which need google-cloud-storage or boto3).
    """

    def __init__(self, logdir: str | os.PathLike):
        SummaryWriter, record_writer = _import_tensorboardx()
        logdir = os.fspath(logdir)
        if paths.is_remote(logdir):
            record_writer.register_writer_factory(logdir.split(":")[0], _EpathEventFiles())
        self._writer = SummaryWriter(logdir=logdir)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for name, value in metrics.items():
            self._writer.add_scalar(tensorboard_tag(name), float(_to_python_scalar(name, value)),
                                    int(step))

    def write_hparams(self, hparams: Mapping[str, bool | int | float | str]) -> None:
        from tensorboardX.summary import hparams as hparams_summaries

        # The metrics the HParams dashboard shows next to the values (their last scalar).
        shown = ("train/loss", "eval/loss", "eval/perplexity", "perf/tokens_per_sec", "perf/mfu")
        experiment, session_start, _ = hparams_summaries(dict(hparams), dict.fromkeys(shown, 0.0))
        self._writer.file_writer.add_summary(experiment)
        self._writer.file_writer.add_summary(session_start)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _import_tensorboardx():
    """tensorboardX's SummaryWriter and record_writer, imported with torch hidden.

    tensorboardX's writer module imports torch, when it is installed, only to accept torch tensors
    as values; that import took 3.3 s of every run's start on a 2-core host (torch 2.9). maxlm
    writes Python floats, so torch is hidden while tensorboardX loads (unless already imported).
    """
    hide = "torch" not in sys.modules
    if hide:
        sys.modules["torch"] = None  # `import torch` raises ImportError, which tensorboardX expects
    try:
        from tensorboardX import SummaryWriter, record_writer  # only runs that want TB pay for it
    finally:
        if hide:
            del sys.modules["torch"]
    return SummaryWriter, record_writer


class _EpathEventFiles:
    """A tensorboardX writer factory: event files opened through epath."""

    def open(self, path: str) -> paths.AppendFile:
        return paths.AppendFile(path)

    def directory_check(self, path: str) -> None:
        pass  # object stores have no directories to create


class WandbWriter:
    """Rows and the config to a Weights & Biases run (the optional `wandb` package).

    The run's id is `run_id` (`wandb_run_id`: the same at every start of a workdir), and the run
    is resumed when W&B already has it, so a resumed training run goes on in the same W&B run.
    Rows are logged at their training step under the TensorBoard tags (`train/loss`, `eval/loss`,
    ...); W&B takes steps in increasing order only, so a row of a step before the last one logged
    (a resume from an earlier checkpoint, a rollback) is left out, with one warning (metrics.jsonl
    has it). The run's files go under `dir` (None: WANDB_DIR, else wandb's default, the current
    directory). W&B refusing the run (no API key, a bad entity) raises UserError.
    """

    def __init__(self, run_id: str, project: str, entity: str = "", name: str | None = None,
                 dir: str | None = None):
        wandb = import_wandb()
        try:
            self._run = wandb.init(project=project, entity=entity or None, id=run_id, name=name,
                                   resume="allow", dir=dir)
        except wandb.errors.Error as e:
            raise UserError(f"metrics.wandb: W&B refused run {run_id!r} of project {project!r}: {e}") from e
        self._floor = self._run.step  # a resumed run's next W&B step: earlier ones are logged already
        self._warned = False

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        if step < self._floor:
            if not self._warned:
                console.warn(f"W&B takes steps in increasing order: rows of steps before {self._floor} "
                             "(repeated after a resume or a rollback) are left out of W&B; metrics.jsonl has them")
                self._warned = True
            return
        self._floor = step  # more rows of this step (the eval's) join the same W&B row
        self._run.log({tensorboard_tag(name): _to_python_scalar(name, value) for name, value in metrics.items()},
                      step=int(step))

    def write_hparams(self, hparams: Mapping[str, bool | int | float | str]) -> None:
        # a resumed run may change keys (steps, a lower lr): W&B refuses a changed value unless allowed
        self._run.config.update(dict(hparams), allow_val_change=True)

    def flush(self) -> None:
        pass  # wandb has no flush: each row goes to wandb-core (its own process) when logged

    def close(self) -> None:
        self._run.finish()  # commits the last step's row


WANDB_INSTALL = "make install-wandb, or pip install -e '.[wandb]'"
WANDB_RUN_ID_FILE = "wandb_run_id"


def import_wandb():
    """The `wandb` module; UserError naming the install line when it does not import."""
    try:
        import wandb  # only runs that ask for W&B need it (an optional dependency)
    except ImportError as e:
        raise UserError(f"metrics.wandb=True needs the wandb package ({e}): {WANDB_INSTALL}") from e
    return wandb


def check_writers(metrics_cfg) -> None:
    """UserError (exit 2) when a writer `metrics_cfg` (a config's `metrics`) asks for cannot be
    made here; a command calls it before it writes anything, on every process of the job at once
    (W&B's credentials are process 0's, which alone writes to W&B)."""
    if metrics_cfg.wandb:
        import_wandb()
        processes.from_process_0(lambda: check_wandb_credentials() or b"")


WANDB_OFFLINE_MODES = ("offline", "dryrun", "disabled")


def check_wandb_credentials() -> None:
    """UserError when W&B would log online without an API key for its server: wandb.init refuses
    that only once the run has started writing. An offline run (WANDB_MODE=offline, uploaded later
    with `wandb sync`) needs none. The lookup is wandb's own (WANDB_API_KEY, its identity token
    file, ~/.netrc, its settings), asked not to prompt."""
    if os.environ.get("WANDB_MODE", "").lower() in WANDB_OFFLINE_MODES:
        return
    from wandb.sdk.lib import wbauth

    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
    try:
        found = wbauth.authenticate_session(host=host, source="maxlm", prompt=False, update_session=False)
    except Exception as e:  # a key of the wrong form, two sources set at once
        raise UserError(f"metrics.wandb=True: the W&B credentials for {host} are not usable ({e})") from None
    if found is None:
        raise UserError(f"metrics.wandb=True: no W&B API key for {host} on this machine: run `wandb login` or set "
                        "WANDB_API_KEY; or log offline (WANDB_MODE=offline) and upload later with `wandb sync`")


def wandb_run_id(workdir, override: str = "") -> str:
    """The W&B run id of the run in `workdir`: `override` when set, else the one in
    WORKDIR/wandb_run_id, made (8 random base-36 characters, as wandb's own) and written there on
    the first call, so every start of the workdir continues one W&B run."""
    if override:
        return override
    path = paths.workdir_path(workdir) / WANDB_RUN_ID_FILE
    if path.exists() and (recorded := path.read_text().strip()):
        return recorded
    run_id = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    path.write_text(run_id + "\n")
    return run_id


class MultiWriter:
    """Fans every call out to several writers, in order."""

    def __init__(self, writers: Iterable[MetricWriter]):
        self._writers = tuple(writers)

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        for writer in self._writers:
            writer.write(step, metrics)

    def write_hparams(self, hparams: Mapping[str, bool | int | float | str]) -> None:
        for writer in self._writers:
            writer.write_hparams(hparams)

    def flush(self) -> None:
        for writer in self._writers:
            writer.flush()

    def close(self) -> None:
        for writer in self._writers:
            writer.close()


class NullWriter:
    """Writes nothing; what non-primary processes get."""

    def write(self, step: int, metrics: Mapping[str, float]) -> None:
        pass

    def write_hparams(self, hparams: Mapping[str, bool | int | float | str]) -> None:
        pass

    def flush(self) -> None:
        pass

    def close(self) -> None:
        pass


def make_writers(workdir: str | os.PathLike, is_primary: bool,
                 tensorboard: bool = True, wandb=None) -> MetricWriter:
    """WORKDIR/metrics.jsonl (+ TensorBoard event files in WORKDIR, + a W&B run when `wandb`, a
    config's `metrics` section, is given) on the primary process.

    Every process calls this; only the primary (process 0) touches the disk,
    so multi-host runs do not write N copies of the same metrics.
    """
    if not is_primary:
        return NullWriter()
    workdir = paths.workdir_path(workdir)  # local or remote (gs://...): see maxlm/runtime/paths.py
    writers: list[MetricWriter] = [JsonlWriter(workdir / "metrics.jsonl")]
    if tensorboard:
        writers.append(TensorBoardWriter(os.fspath(workdir)))
    if wandb is not None:
        # wandb writes its files through the local filesystem: WORKDIR/wandb/ unless WANDB_DIR or a gs:// workdir
        local = os.fspath(workdir) if not paths.is_remote(workdir) and "WANDB_DIR" not in os.environ else None
        writers.append(WandbWriter(wandb_run_id(workdir, wandb.wandb_run_id), wandb.wandb_project,
                                   wandb.wandb_entity, name=workdir.name, dir=local))
    return MultiWriter(writers)


def read_metrics(path) -> list[dict]:
    """The rows of a metrics.jsonl (a local path or URL, or a workdir holding one), in file order.

    A line cut short by a killed run is skipped. A resumed run repeats some steps: readers keep
    the last row written for a step. Non-finite floats come back as the strings "nan", "inf",
    "-inf" (`float()` turns them into numbers). Raises FileNotFoundError when there is no file.
    """
    path = paths.workdir_path(path)
    if path.name != "metrics.jsonl":
        path = path / "metrics.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"no metrics.jsonl in {path.parent}")
    rows = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "step" in row:
            rows.append(row)
    return rows
