"""Storage that refuses a checkpoint (a full disk, a read-only or forbidden directory, a bucket that
says no) ends the run with one line, removes its partial directory and keeps the last good
checkpoint; a start-up warning says when the disk cannot hold the checkpoints to come."""

import errno
import subprocess
import sys

import jax.numpy as jnp
import pytest
from etils import epath
from ml_collections import ConfigDict

from maxlm.checkpoint import store as checkpoint
from maxlm.runtime import paths
from tests.helpers import ROOT, command_env

# A tiny.py checkpoint takes about 1.2 MB: 1.7 MB holds step 10 and not step 20 beside it.
FULL_DISK_THEN_READ_ONLY = """
set -u
mkdir -p "$WD/checkpoints"
mount -t tmpfs -o size=1700k tmpfs "$WD/checkpoints" || exit 99
"$@" --config.steps=30
echo "rc=$?"; ls "$WD/checkpoints"; echo "--- read-only"
mount -o remount,ro "$WD/checkpoints"
"$@" --config.steps=20
echo "rc=$?"; ls "$WD/checkpoints"
"""


def mount_namespace_or_skip():
    probe = subprocess.run(["unshare", "-m", "sh", "-c", "mount -t tmpfs tmpfs /mnt"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a private mount namespace (root, CAP_SYS_ADMIN): {probe.stderr.strip()}")


@pytest.mark.slow
@pytest.mark.ci
def test_a_full_disk_and_a_read_only_one_end_the_run_in_one_line_keeping_the_last_good_checkpoint(tmp_path, data_dirs):
    mount_namespace_or_skip()
    workdir = tmp_path / "run"
    train = [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={workdir}",
             "--config.eval.every_steps=0", "--config.metrics.tensorboard=False",
             *(f"--config.{k}={v}" for k, v in data_dirs.items())]
    result = subprocess.run(["unshare", "-m", "sh", "-c", FULL_DISK_THEN_READ_ONLY, "sh", *train], cwd=ROOT,
                            capture_output=True, text=True, timeout=600,
                            env=command_env(tmp_path, devices=None, WD=str(workdir)))
    out, err = result.stdout, result.stderr
    full, read_only = out.split("--- read-only")
    assert "rc=1\n10\n" in full and "rc=1\n10\n" in read_only, out + err[-3000:]  # no partial 20 left
    assert "Traceback" not in err, err[-3000:]
    assert "has 1.7 MB free, less than the" in err  # warned at start
    failures = [line for line in err.splitlines() if line.startswith("maxlm: could not write")]
    assert len(failures) == 2, err[-3000:]
    assert f"the checkpoint of step 20 to {workdir / 'checkpoints'}: not enough free space (it needs about" in failures[0]
    assert "the last good checkpoint is step 10: make room" in failures[0]
    assert "step 20" in failures[1] and "read-only file system" in failures[1]
    assert "the last good checkpoint is step 10: let the run write there" in failures[1]


def small_checkpointer(directory, max_to_keep=2):
    return checkpoint.Checkpointer(str(directory), ConfigDict({"max_to_keep": max_to_keep, "keep_period": 0, "local_dir": ""}))


def state_at(step):
    return {"step": jnp.asarray(step, jnp.int32), "w": jnp.ones((256,))}


def test_a_write_refused_inside_orbax_removes_its_partial_directory_and_keeps_the_last_good(tmp_path, monkeypatch):
    ckpt = small_checkpointer(tmp_path)
    ckpt.save(1, state_at(1), {}, {})
    ckpt.wait()
    partial = epath.Path(ckpt.directory) / f"2{checkpoint.TMP_SUFFIX}"

    def refused(step, args, force):  # what orbax's background write raises on a bucket that says no
        partial.mkdir()
        (partial / "state").mkdir()
        raise ValueError("PERMISSION_DENIED: Error writing ... 403 Forbidden") from OSError(errno.EACCES, "denied")

    monkeypatch.setattr(ckpt.manager, "save", refused)
    with pytest.raises(checkpoint.StorageError, match=r"step 2 to .*: permission denied; the last good checkpoint "
                                                      r"is step 1: let the run write there"):
        ckpt.save(2, state_at(2), {}, {})
    assert not partial.exists() and ckpt.steps() == [1]
    ckpt.close()  # does not raise the refusal again


@pytest.mark.parametrize(("error", "reason"), [
    (OSError(errno.ENOSPC, "No space left on device"), "no space left on device"),
    (ValueError("RESOURCE_EXHAUSTED: Failed to write 662008 bytes [os_error_code='28']"), "no space left on device"),
    (OSError(errno.EROFS, "Read-only file system"), "read-only file system"),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), "disk quota exceeded"),
    (ValueError("PERMISSION_DENIED: Error writing local file \"/ckpt/5/d/x\" [os_error_code='13']"), "permission denied"),
    (ValueError("RESOURCE_EXHAUSTED: Failed to write"), "storage is out of space (RESOURCE_EXHAUSTED)"),
    # gcsfs's answer to a 403 (gcsfs/retry.py validate_response), as the write probe meets it
    (OSError("Forbidden: bkt/run/checkpoints/.maxlm-write-probe\nuser lacks storage.objects.create"),
     "the bucket refused the write (403 Forbidden)"),
    (RuntimeError("the save failed"), "the bucket refused the write (403 Forbidden)"),  # from gcsfs's HttpError(403)
    (ValueError("shapes differ"), None),
    # words in a path are no refusal (issue 55: `gs://b/exp403/` read as a 403, the partial checkpoint deleted)
    (ValueError("NOT_FOUND: gs://b/exp403/forbidden-permission denied/checkpoints/5 [os_error_code='2']"), None),
    (RuntimeError("no space left in gs://b/exp403/"), None),
])
def test_storage_refusals_are_named(error, reason):
    if str(error) == "the save failed":  # raised from gcsfs's own error object, as orbax re-raises it
        from gcsfs.retry import HttpError

        error.__cause__ = HttpError({"code": 403, "message": "user lacks storage.objects.create"})
    assert checkpoint.storage_problem(error) == reason


def test_the_start_warns_when_the_disk_cannot_hold_the_checkpoints_to_come(tmp_path, monkeypatch, capsys):
    ckpt = small_checkpointer(tmp_path, max_to_keep=3)
    monkeypatch.setattr(paths, "free_bytes", lambda path: 3000)
    ckpt.warn_if_short_of_space(1000)  # 3 + 1 of 1000 bytes: 4000 wanted
    assert "has 2.9 KB free, less than the 3.9 KB that checkpoint.max_to_keep=3" in capsys.readouterr().err
    monkeypatch.setattr(paths, "free_bytes", lambda path: 4000)
    ckpt.warn_if_short_of_space(1000)
    assert capsys.readouterr().err == ""
    ckpt.close()
