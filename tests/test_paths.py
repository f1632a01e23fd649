"""Workdirs at gs:// URLs: every write and scan goes through etils.epath, none through the OS.

The parts (metrics, events, checkpoint scans, the profile) write to a fake bucket:
`epath.testing.mock_epath` routes every epath call through functions that map `gs://BUCKET/...`
to a local directory, so a code path that wrote a gs:// URL with plain `open`/`os.makedirs`
instead would create a `gs:` directory in the working directory (checked) or miss the bucket
(checked). A whole run, checkpoints included, trains and resumes against the Cloud Storage
emulator of tests/gcs.py."""

import json
import os

import jax
import numpy as np
import pytest
from etils import epath

from maxlm import config as config_lib
from maxlm.checkpoint import __main__ as checkpoint_command, store as checkpoint
from maxlm.observe import goodput, metrics, profiler
from maxlm.runtime import gcs, paths
from maxlm.train import loop
from tests.helpers import ROOT, load_config, losses, metrics_rows, saved_state, with_overrides


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    """`gs://` served from tmp_path/gcs; the test runs in tmp_path/cwd."""
    root = tmp_path / "gcs"
    root.mkdir()

    def local(path):
        path = os.fspath(path)
        return str(root / path[len("gs://"):]) if path.startswith("gs://") else path

    def one(fn, path, *args, **kwargs):
        return fn(local(path), *args, **kwargs)

    def open_(fn, path, mode):  # objects need no directories: writing one creates its parents
        if set(mode) & set("wa"):
            os.makedirs(os.path.dirname(local(path)), exist_ok=True)
        return fn(local(path), mode)

    def two(fn, path, dst, *args, **kwargs):
        return fn(local(path), local(dst), *args, **kwargs)

    from tensorboardX import record_writer  # maxlm registers its gs:// event writer there

    monkeypatch.setattr(record_writer, "REGISTERED_FACTORIES", dict(record_writer.REGISTERED_FACTORIES))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    names = ("exists", "glob", "isdir", "listdir", "makedirs", "mkdir", "remove", "rmtree", "stat", "walk")
    with epath.testing.mock_epath(**{n: one for n in names}, open=open_, rename=two, replace=two, copy=two):
        yield root
    assert not (tmp_path / "cwd" / "gs:").exists() and not (ROOT / "gs:").exists()


def test_workdir_paths():
    assert os.fspath(paths.workdir_path("gs://b/run")) == "gs://b/run"
    assert os.fspath(paths.workdir_path("runs/x")) == os.path.abspath("runs/x")
    assert checkpoint.checkpoint_dir("gs://b/run") == "gs://b/run/checkpoints"
    assert paths.is_remote("s3://b/x") and not paths.is_remote("/mnt/shared/x")


@pytest.fixture
def gcs_run(monkeypatch):
    """gs://BUCKET/run on the Cloud Storage stand-in of tests/gcs.py."""
    from tensorboardX import record_writer  # maxlm registers its gs:// event writer there

    from tests.gcs import BUCKET, fake_gcs

    monkeypatch.setattr(record_writer, "REGISTERED_FACTORIES", dict(record_writer.REGISTERED_FACTORIES))
    with fake_gcs():
        yield f"gs://{BUCKET}/run"


def test_metrics_and_tensorboard_in_a_bucket(gcs_run, tmp_path):
    from tensorboard.backend.event_processing import event_accumulator as ea

    writer = metrics.make_writers(gcs_run, is_primary=True, tensorboard=True)
    writer.write(1, {"loss": 2.5})
    writer.write(2, {"loss": 2.0})  # within REMOTE_FLUSH_SECONDS of the first: held in memory
    assert [row["step"] for row in metrics_rows(gcs_run)] == [1]
    writer.flush()  # appended to the object (the event file's first flush makes it)
    assert [row["step"] for row in metrics_rows(gcs_run)] == [1, 2]
    writer.write(3, {"loss": 1.5})
    writer.close()  # appends the rest to both
    assert [row["step"] for row in metrics_rows(gcs_run)] == [1, 2, 3]
    names = [p.name for p in epath.Path(gcs_run).iterdir()]
    events = [n for n in names if n.startswith("events.out.tfevents.")]
    assert len(events) == 1 and not [n for n in names if n.startswith(gcs.SEGMENT_PREFIX)]
    (tmp_path / "tb").mkdir()  # the event file as TensorBoard reads it, composed of several flushes
    (tmp_path / "tb" / events[0]).write_bytes((epath.Path(gcs_run) / events[0]).read_bytes())
    read = ea.EventAccumulator(str(tmp_path / "tb"), size_guidance={ea.SCALARS: 0})
    read.Reload()
    assert [(e.step, e.value) for e in read.Scalars("train/loss")] == [(1, 2.5), (2, 2.0), (3, 1.5)]

    jsonl = epath.Path(gcs_run) / "metrics.jsonl"
    jsonl.write_text(jsonl.read_text() + '{"step": 4, "lo')  # a run killed mid-line
    resumed = metrics.JsonlWriter(jsonl)
    resumed.write(4, {"loss": 1.25})
    resumed.close()
    lines = jsonl.read_text().splitlines()
    assert json.loads(lines[-1]) == {"step": 4, "loss": 1.25} and len(lines) == 5


def test_a_flush_to_a_bucket_sends_only_the_new_bytes(gcs_run):
    """Each flush adds its bytes by compose (GCS's append): the upload is the new bytes alone,
    however long the file has grown."""
    from tests.gcs import uploads

    url = f"{gcs_run}/metrics.jsonl"
    old = b"".join(b'{"step": %d}\n' % step for step in range(10_000))
    epath.Path(url).write_bytes(old)  # a long run's file, resumed
    appended = paths.AppendFile(url, min_interval=0)
    assert appended.tail(2) == b"}\n"
    uploads.clear()
    for new in (b'{"step": 10000}\n', b'{"step": 10001}\n'):
        appended.write(new)
        assert appended.tail(len(new) + 2) == b"}\n" + new  # the object's end, then what it holds
        appended.flush()
    appended.close()
    assert [size for _, size in uploads] == [16, 16]
    assert not [name for name, _ in uploads if name.endswith("metrics.jsonl")]  # never the file whole
    assert epath.Path(url).read_bytes() == old + b'{"step": 10000}\n{"step": 10001}\n'


def test_a_remote_file_without_compose_is_rewritten_whole(gcs_run, monkeypatch):
    """Where the store has no compose (a GCS zonal bucket), a flush rewrites the object."""
    def no_compose(url, data):
        raise NotImplementedError("no compose here")

    monkeypatch.setattr(gcs, "append", no_compose)
    url = f"{gcs_run}/metrics.jsonl"
    appended = paths.AppendFile(url, min_interval=0)
    for line in (b"one\n", b"two\n", b"three\n"):
        appended.write(line)
        appended.flush()
    assert appended.tail(8) == b"o\nthree\n"
    appended.close()
    assert epath.Path(url).read_bytes() == b"one\ntwo\nthree\n"


def test_checkpoint_scans_in_a_bucket(bucket, capsys):
    directory = bucket / "bkt" / "run" / "checkpoints"
    for step in ("10", "20"):
        for name in ("state/manifest.ocdbt", "state/_sharding", "meta/metadata", "config/metadata"):
            (directory / step / name).parent.mkdir(parents=True, exist_ok=True)
            (directory / step / name).write_text(json.dumps({"step": int(step)}))
    (directory / "10" / "_CHECKPOINT_METADATA").write_text("{}")  # 20 lacks it: damaged
    (directory / "30.orbax-checkpoint-tmp-1").mkdir()
    found = checkpoint.step_dirs("gs://bkt/run/checkpoints")
    assert found["complete"] == [(10, "gs://bkt/run/checkpoints/10"), (20, "gs://bkt/run/checkpoints/20")]
    assert found["incomplete"] == [(30, "gs://bkt/run/checkpoints/30.orbax-checkpoint-tmp-1")]
    assert checkpoint.file_problem("gs://bkt/run/checkpoints/10") is None
    assert "_CHECKPOINT_METADATA" in checkpoint.file_problem("gs://bkt/run/checkpoints/20")
    assert checkpoint.read_json("gs://bkt/run/checkpoints/10", "meta") == {"step": 10}
    assert checkpoint.resolve_restore_from("gs://bkt/run") == "gs://bkt/run/checkpoints/10"
    assert checkpoint_command.main(["list", "gs://bkt/run"]) == 0
    listing = capsys.readouterr().out
    assert "gs://bkt/run/checkpoints: 3 checkpoint(s)" in listing and "incomplete" in listing


@pytest.mark.ci
@pytest.mark.slow
def test_training_in_a_gs_workdir_on_a_cloud_storage_stand_in(data_dirs, tmp_path, monkeypatch):
    """A real run at gs://BUCKET/run against the Cloud Storage emulator on 127.0.0.1 (tests/gcs.py):
    config.json, metrics.jsonl, the TensorBoard events and the orbax checkpoints, their array data
    through tensorstore's own GCS driver, all land in the bucket and nothing in a local `gs:`
    directory; `checkpoint verify` restores them from there; a rerun resumes from the bucket's step
    2, and its losses and final state equal a local uninterrupted run's bit for bit."""
    from tests.gcs import BUCKET, fake_gcs

    monkeypatch.chdir(tmp_path)  # a gs:// URL written with the OS's open/makedirs would make ./gs:
    overrides = {**data_dirs, "steps": 2, "log_every_steps": 1, "eval.every_steps": 0, "optim.warmup_steps": 1}
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), overrides), jax.device_count())
    run = f"gs://{BUCKET}/run"
    with fake_gcs():
        loop.train_and_evaluate(cfg, run)
        remote = epath.Path(run)
        assert json.loads((remote / "config.json").read_text())["steps"] == 2
        assert list(remote.glob("events.out.tfevents.*"))
        assert (remote / "checkpoints" / "2" / "state" / "manifest.ocdbt").exists()  # tensorstore's OCDBT
        assert checkpoint_command.main(["verify", run]) == 0
        cfg.steps = 3
        last = loop.train_and_evaluate(cfg, run)  # resumes at step 2
        assert last["step"] == 3 and last["first_loss"] == last["loss"]  # one step run this time
        assert goodput.read(run)["attempts"] == 2 and goodput.read(run)["max_step"] == 3  # goodput.json too
        got, got_state = losses(run), saved_state(run, 3)
    loop.train_and_evaluate(cfg, str(tmp_path / "local"))
    assert sorted(got) == [1, 2, 3] and got == losses(tmp_path / "local")
    jax.tree.map(np.testing.assert_array_equal, got_state, saved_state(tmp_path / "local", 3))
    assert not (tmp_path / "gs:").exists() and not (ROOT / "gs:").exists()


def test_a_profile_of_a_gs_workdir_lands_in_the_bucket(bucket, data_dirs):
    """The profiler writes with the OS: the trace is made locally and copied up when it ends."""
    overrides = {**data_dirs, "steps": 2, "log_every_steps": 1, "eval.every_steps": 0, "optim.warmup_steps": 1,
                 "profile.start_step": 1, "profile.num_steps": 1}
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), overrides), jax.device_count())
    trace = profiler.StepProfiler(cfg.profile, "gs://bkt/run")
    trace.before_step(1)
    jax.block_until_ready(jax.jit(lambda x: x * 2)(jax.numpy.ones(4)))
    assert trace.after_step(2, jax.numpy.ones(1))
    files = [p.name for p in (bucket / "bkt" / "run" / "profile").rglob("*") if p.is_file()]
    assert any(f.endswith(".xplane.pb") for f in files) and any(f.endswith(".trace.json.gz") for f in files)


def test_a_task_a_tokenizer_and_a_hf_folder_are_read_from_gs(tmp_path, sp_model, monkeypatch):
    """The files a run reads by path (a task .jsonl, the SentencePiece model, a Hugging Face folder
    for `checkpoint.init_from_hf`) at gs:// URLs, against the Cloud Storage stand-in of
    tests/gcs.py: each reads as its local copy does (the HF weights onto a sharded mesh, bit for bit,
    a block's rows read a few at a time), and a missing one is the local one's error."""
    from maxlm.data import tokenizers as tokenizer_lib
    from maxlm.data.errors import DataError
    from maxlm.eval import tasks
    from maxlm.hf import files as hf
    from maxlm.sharding import mesh as mesh_lib, state as state_lib
    from tests.gcs import BUCKET, fake_gcs
    from tests.helpers import random_params

    monkeypatch.chdir(tmp_path)
    task = tmp_path / "capitals.jsonl"
    task.write_text("\n".join(json.dumps({"context": f"Q{i}:", "choices": [" a", " b"], "answer": i % 2})
                              for i in range(5)) + "\n")
    cfg = config_lib.resolve(with_overrides(load_config("tiny"), {"mesh.fsdp": 4, "mesh.tensor": 2}),
                             jax.device_count())
    params = random_params(cfg.model, seed=7)
    hf.export(params, cfg, str(tmp_path / "hf"))
    with fake_gcs():
        bucket = epath.Path(f"gs://{BUCKET}")
        for local in [task, sp_model, *(tmp_path / "hf").iterdir()]:
            name = local.name if local.parent != tmp_path / "hf" else f"hf/{local.name}"
            (bucket / name).write_bytes(local.read_bytes())
        remote_task = tasks.load_task(f"gs://{BUCKET}/capitals.jsonl")
        assert remote_task.examples == tasks.load_task(str(task)).examples and remote_task.name == "capitals"
        with pytest.raises(DataError, match=f"^gs://{BUCKET}/none.jsonl: no such task file$"):
            tasks.load_task(f"gs://{BUCKET}/none.jsonl")

        sp_cfg = with_overrides(load_config("tiny"), {"data.tokenizer": f"gs://{BUCKET}/tok.model",
                                                      "model.vocab_size": 320})
        remote_tok = tokenizer_lib.checked_tokenizer(sp_cfg)
        assert remote_tok.fingerprint == tokenizer_lib.load_tokenizer(str(sp_model)).fingerprint
        assert remote_tok.spec == f"gs://{BUCKET}/tok.model"
        with pytest.raises(ValueError, match="tokenizer model file not found"):
            tokenizer_lib.load_tokenizer(f"gs://{BUCKET}/none.model")

        cfg.checkpoint.init_from_hf = f"gs://{BUCKET}/hf"
        hf.check_init_from_hf(cfg)
        monkeypatch.setattr(hf, "_CHUNK_BYTES", 16 << 10)  # a block read in several pieces
        mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
        abstract = state_lib.abstract_params(cfg.model, state_lib.param_shardings(cfg.model, mesh, rules))
        loaded = hf.load_params(f"gs://{BUCKET}/hf", cfg.model, abstract)
        with pytest.raises(config_lib.ConfigError, match="no config.json"):
            hf.read_dir(f"gs://{BUCKET}/none")
    for got, want, target in zip(*map(jax.tree.leaves, (loaded, params, abstract))):
        assert got.sharding == target.sharding
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert not (tmp_path / "gs:").exists()


@pytest.mark.parametrize("emulator, where", [("http://127.0.0.1:9", ("127.0.0.1", 9)), ("localhost:4443", ("localhost", 4443)),
                                             ("https://gcs.example", ("gcs.example", 443)), ("", ("storage.googleapis.com", 443))])
def test_the_endpoint_is_the_one_gcsfs_uses(monkeypatch, emulator, where):
    monkeypatch.setenv("STORAGE_EMULATOR_HOST", emulator)
    assert gcs.endpoint() == where


def test_a_gs_workdir_that_cannot_be_reached_is_one_line_and_exit_2_in_seconds(tmp_path):
    """Issue 54: with no network, gcsfs retried for 53 s and the command printed a 186-line
    traceback with exit 1. Here the endpoint is a closed port on this machine."""
    import subprocess
    import sys
    import time

    from tests.helpers import command_env, free_port

    env = command_env(tmp_path, devices=None, STORAGE_EMULATOR_HOST=f"http://127.0.0.1:{free_port()}")
    for command in (["maxlm.train", "--config=configs/tiny.py"], ["maxlm.eval"]):
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", *command, "--workdir=gs://bucket/run"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and time.monotonic() - start < 15 + 30  # + a loaded machine's start-up
        [line] = done.stderr.strip().splitlines()
        assert "gs://bucket/run: Cloud Storage (127.0.0.1:" in line and "cannot be reached" in line, line


def service_account_key(path, token_uri: str) -> str:
    """A service-account key file (a fresh RSA key) whose token refreshes go to `token_uri`."""
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import rsa

    pem = rsa.generate_private_key(65537, 2048).private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    path.write_text(json.dumps({"type": "service_account", "project_id": "example-project", "private_key_id": "1",
                                "private_key": pem.decode(), "token_uri": token_uri,
                                "client_email": "runner@example-project.iam.gserviceaccount.com"}))
    return str(path)


COMMANDS = (["maxlm.train", "--config=configs/tiny.py"], ["maxlm.eval"])


def run_commands(workdir: str, env: dict, home, commands=COMMANDS) -> list[list[str]]:
    """`commands` at `workdir`, each ending with exit 2 in under 30 s (start-up on a loaded machine
    included; gcsfs's retries of a refused token alone take 31 s): each one's stderr lines."""
    import subprocess
    import sys
    import time

    from tests.helpers import command_env

    lines = []
    for command in commands:
        start = time.monotonic()
        done = subprocess.run([sys.executable, "-m", *command, f"--workdir={workdir}"], cwd=ROOT,
                              env=command_env(home, devices=None, **env), capture_output=True, text=True, timeout=120)
        assert done.returncode == 2 and time.monotonic() - start < 30, (done.returncode, done.stderr[-3000:])
        lines.append(done.stderr.strip().splitlines())
    return lines


@pytest.mark.parametrize("refuse, bucket, said", [
    (401, "maxlm-test", "HTTP 401 from Cloud Storage: no credentials (none were found on this machine); "
                        "run `gcloud auth application-default login`"),
    ("key", "maxlm-test", "HTTP 401 from Cloud Storage: the credentials found were refused"),
    (403, "maxlm-test", "HTTP 403 from Cloud Storage: the account has no access to bucket maxlm-test "
                        "(runner@example-project.iam.gserviceaccount.com does not have storage.objects.list"),
    (None, "no-such-bucket", "HTTP 404 from Cloud Storage: bucket no-such-bucket does not exist"),
], ids=["no credentials", "credentials refused", "no access", "no bucket"])
def test_a_gs_workdir_cloud_storage_refuses_is_one_line_and_exit_2_in_seconds(tmp_path, refuse, bucket, said):
    """Issue 54: the endpoint answers but refuses (no credentials; a key whose token refresh is
    refused, which gcsfs retried for 39 s; an account without access), or there is no such bucket:
    each was a 60-300-line traceback with exit 1. Now one line, exit 2, nothing written."""
    from tests import gcs as stand_in

    with stand_in.fake_gcs(refuse=401 if refuse == "key" else refuse) as env:
        if refuse == "key":  # the token endpoint, on the stand-in, refuses the key's grant
            env = {**env, "GOOGLE_APPLICATION_CREDENTIALS": service_account_key(
                tmp_path / "key.json", f"{env['STORAGE_EMULATOR_HOST']}/token")}
        for lines in run_commands(f"gs://{bucket}/run", env, tmp_path):
            assert len(lines) == 1 and f"gs://{bucket}/run: {said}" in lines[0], lines
        assert not stand_in.uploads and not (ROOT / "gs:").exists()


def test_a_gs_workdir_not_made_yet_passes_the_access_check(tmp_path):
    """A new run's prefix has no objects yet: no refusal, the command goes on (and eval finds no
    run there)."""
    from tests.gcs import BUCKET, fake_gcs

    with fake_gcs() as env:
        [[*_, line]] = run_commands(f"gs://{BUCKET}/new/run", env, tmp_path, [["maxlm.eval"]])
    assert line.startswith(f"maxlm: config error: no config.json in gs://{BUCKET}/new/run "), line


def test_a_gs_endpoint_that_does_not_answer_is_one_line(monkeypatch):
    """An endpoint that takes the connection but never answers: a UserError after
    ACCESS_TIMEOUT_SEC, not aiohttp's 5 minutes and gcsfs's retries."""
    import socket

    from maxlm.runtime.errors import UserError

    with socket.create_server(("127.0.0.1", 0)) as silent:  # the kernel accepts; nobody reads
        monkeypatch.setenv("STORAGE_EMULATOR_HOST", f"http://127.0.0.1:{silent.getsockname()[1]}")
        monkeypatch.setattr(gcs, "ACCESS_TIMEOUT_SEC", 1.0)
        with pytest.raises(UserError, match=r"^gs://b/run: Cloud Storage \(127.0.0.1:\d+\) did not answer within 1 s$"):
            gcs.check_access("gs://b/run")
