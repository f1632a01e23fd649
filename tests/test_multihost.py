"""Multi-process runs that cannot hang: every process agrees on which checkpoint is damaged, a
workdir the processes do not share is exit 2 at start, and what process 0 alone decides (the data
build, a file only it reads) reaches every process, a failure included. Real local processes over
jax.distributed (gloo collectives on 127.0.0.1)."""

import json
import shutil
import subprocess
import sys

import jax
import pytest

from maxlm import config as config_lib
from maxlm.hf import files as hf
from tests.helpers import ROOT, command_env, free_port, load_config, losses, random_params

pytestmark = pytest.mark.slow

# `python -m maxlm.train`, except that process 1 reads checkpoint MAXLM_TEST_BLIND_STEP as damaged
# and its listing of the checkpoints lacks MAXLM_TEST_STALE_STEP (as a process on a node with a
# stale or broken view of the shared filesystem would).
TRAIN_WITH_A_BLIND_PROCESS = """
import os, sys
from maxlm.train import __main__ as train_command
from maxlm.checkpoint import store as checkpoint
from maxlm import cli
blind = os.environ.get("MAXLM_TEST_BLIND_STEP")
if blind and os.environ["JAX_PROCESS_ID"] == "1":
    readable = checkpoint.file_problem
    checkpoint.file_problem = lambda path: (
        "unreadable from this process" if os.path.basename(path) == blind else readable(path))
stale = os.environ.get("MAXLM_TEST_STALE_STEP")
if stale and os.environ["JAX_PROCESS_ID"] == "1":
    listed = checkpoint.step_dirs
    def stale_listing(directory):
        found = listed(directory)
        return dict(found, complete=[(s, p) for s, p in found["complete"] if str(s) != stale])
    checkpoint.step_dirs = stale_listing
sys.argv = ["maxlm.train", *sys.argv[1:]]
cli.run(train_command.main, train_command.define_flags)
"""

# `python -m maxlm.train`, except that process 0's data build fails with an OSError (a storage
# error, as gcsfs or a Beam runner raises them).
TRAIN_WITH_A_FAILING_BUILD = """
import os, sys
from maxlm.data.prepare import build
from maxlm.train import __main__ as train_command
from maxlm import cli
if os.environ["JAX_PROCESS_ID"] == "0":
    def failing(*args, **kwargs):
        raise OSError(5, "Input/output error (the test's storage failure)")
    build._build = failing
sys.argv = ["maxlm.train", *sys.argv[1:]]
cli.run(train_command.main, train_command.define_flags)
"""


def train_flags(workdir, data_dirs, *extra):
    return ["--config=configs/tiny.py", f"--workdir={workdir}", "--config.steps=9",
            "--config.checkpoint.every_steps=3", "--config.log_every_steps=1",
            "--config.eval.every_steps=0", "--config.metrics.tensorboard=False",
            *(f"--config.{k}={v}" for k, v in data_dirs.items()), *extra]


def two_processes(tmp_path, command, wrap=lambda i, argv: argv, timeout=300, **env):
    """Runs `command` as processes 0 and 1 of one job (4 fake devices each); their results. A
    process still running after `timeout` seconds (a hang) fails the test."""
    port = free_port()
    procs = [subprocess.Popen(
        wrap(i, command), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env=command_env(tmp_path, devices=4, JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
                        JAX_NUM_PROCESSES="2", JAX_PROCESS_ID=str(i), **env))
        for i in range(2)]
    try:
        return [(p.communicate(timeout=timeout), p.returncode) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def hidden_from_process_1(path):
    """A `wrap` for `two_processes`: process 1 runs in a mount namespace of its own with an empty
    tmpfs over `path` (a host-local directory on a multi-host job). Skips the test where a
    private mount namespace is not allowed."""
    probe = subprocess.run(["unshare", "-m", "sh", "-c", f"mount -t tmpfs tmpfs {path}"],
                           capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"needs a private mount namespace (root, CAP_SYS_ADMIN): {probe.stderr.strip()}")

    def wrap(i, argv):
        if i == 0:
            return argv
        return ["unshare", "-m", "sh", "-c", f'mount -t tmpfs tmpfs {path} && exec "$@"', "sh", *argv]

    return wrap


@pytest.mark.ci
def test_a_checkpoint_one_process_reads_as_damaged_is_skipped_by_all(tmp_path, data_dirs):
    """Process 1 alone reads checkpoint 6 as damaged: both processes set it aside and resume from
    3 (deciding alone, one would restore 6 and the other 3, and the job would hang), then train
    on to the uninterrupted run's losses, saving on process 0's clock as well. Process 1's listing
    also lacks checkpoint 3: the processes check process 0's list, or they would run different
    numbers of collectives."""
    reference = tmp_path / "reference"
    done = subprocess.run([sys.executable, "-m", "maxlm.train", *train_flags(reference, data_dirs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=command_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    shutil.rmtree(run / "checkpoints" / "9")  # checkpoints 3 and 6 left
    (run / "metrics.jsonl").write_text("")
    # time-based saves too: process 0's clock, broadcast at each log step, read one step later
    command = [sys.executable, "-c", TRAIN_WITH_A_BLIND_PROCESS,
               *train_flags(run, data_dirs, "--config.checkpoint.every_minutes=1e-5")]
    results = two_processes(tmp_path, command, MAXLM_TEST_BLIND_STEP="6", MAXLM_TEST_STALE_STEP="3")
    for (out, err), code in results:
        assert code == 0, err[-3000:]
    err0 = results[0][0][1]
    assert "damaged as process 1 reads it" in err0 and "6.damaged" in err0, err0[-3000:]
    assert f"resumed from {run / 'checkpoints'} at step 3" in err0
    assert "replacing damaged checkpoint" in err0  # marked, then replaced by the new save of step 6
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["3", "6", "9"]
    got, want = losses(run), losses(reference)
    assert sorted(got) == list(range(4, 10))
    for step in got:
        assert got[step] == pytest.approx(want[step], rel=1e-4), step


def test_a_workdir_the_processes_do_not_share_is_exit_2(tmp_path, data_dirs):
    """Process 1 runs in a mount namespace of its own with an empty tmpfs over the workdir: a
    node-local path on a multi-node job. Both processes stop with exit 2 and one line naming the
    path, and nothing is left in the workdir."""
    run = tmp_path / "run"
    run.mkdir()
    node_local = hidden_from_process_1(run)
    command = [sys.executable, "-m", "maxlm.train", *train_flags(run, data_dirs)]
    for (out, err), code in two_processes(tmp_path, command, wrap=node_local):
        assert code == 2, err[-3000:]
        assert f"--workdir={run} is not shared by the job's processes: process(es) 1 cannot read" in err
        assert "Traceback" not in err
    assert list(run.iterdir()) == []


def test_processes_that_run_different_configs_stop_on_both_naming_the_keys(tmp_path, data_dirs):
    """Issue 55: process 0 on optim.lr=0.003 and process 1 on 0.001 both trained 20 steps and exited
    0, each applying its own learning rate to its own shards. Now both exit 2 with one line, the same
    on each, before anything is written."""
    run = tmp_path / "run"
    command = [sys.executable, "-m", "maxlm.train", *train_flags(run, data_dirs)]
    lr = {0: "--config.optim.lr=0.003", 1: "--config.optim.lr=0.001"}
    results = two_processes(tmp_path, command, timeout=120, wrap=lambda i, argv: [*argv, lr[i]])
    lines = []
    for (out, err), code in results:
        assert code == 2, err[-3000:]
        assert "Traceback" not in err
        lines += [line for line in err.splitlines() if "do not run the same program" in line]
    assert len(lines) == 2 and lines[0] == lines[1], lines
    assert "process(es) 1 differ from process 0 in optim.lr (process 0: 0.003)" in lines[0]
    assert not run.exists()


@pytest.mark.ci
def test_process_0_prepares_the_data_and_a_cache_the_processes_do_not_share_is_exit_2(tmp_path, data_dirs):
    """With a fresh shared data.cache_dir only process 0 prepares; process 1 reads its shards and
    the job trains. With process 1 in a mount namespace whose tmpfs hides the cache directory (a
    host-local cache on a multi-host job), both stop with exit 2 and one line naming the entry."""
    cache = tmp_path / "cache"
    cache.mkdir()
    def flags(run):
        return [sys.executable, "-m", "maxlm.train", *train_flags(run, {**data_dirs, "data.cache_dir": cache})]
    results = two_processes(tmp_path, flags(tmp_path / "shared"))
    for (out, err), code in results:
        assert code == 0, err[-3000:]
    assert "prepared " in results[0][0][1] and "prepared " not in results[1][0][1]

    shutil.rmtree(cache)
    cache.mkdir()
    host_local_cache = hidden_from_process_1(cache)
    for (out, err), code in two_processes(tmp_path, flags(tmp_path / "local"), wrap=host_local_cache):
        assert code == 2, err[-3000:]
        assert "data.cache_dir is not shared by the job's processes: process(es) 1 cannot read" in err
        assert str(cache) in err and "Traceback" not in err


@pytest.mark.ci  # 17 s, moved out of make test to keep it within 12 minutes (--harness came in)
def test_what_process_0_alone_reads_or_builds_stops_every_process_when_it_fails(tmp_path, data_dirs, sp_model):
    """Process 0 alone builds the data and reads the tokenizer model; when either fails there, every
    process stops with process 0's message at once, rather than wait in a collective for a
    process that has exited (a hang on a pod).
    - Its build raises an OSError (not bad data: a storage error): process 0 exits 1 with its own
      traceback, process 1 exits 1 with one line naming process 0's error.
    - The tokenizer model is at `~/tok.model` and process 0's home lacks it (a file on one host's
      disk): both exit 2 with process 0's one line, though process 1 has the file.
    - `checkpoint.init_from_hf=~/hf` is in process 0's home only: process 0 checks it and both go
      on, but every process reads its own blocks, so both exit 2 naming process 1."""
    fresh_cache = {**data_dirs, "data.cache_dir": tmp_path / "cache"}  # a build, not a cached entry
    command = [sys.executable, "-c", TRAIN_WITH_A_FAILING_BUILD, *train_flags(tmp_path / "run", fresh_cache)]
    ((_, err0), code0), ((_, err1), code1) = two_processes(tmp_path, command, timeout=60)
    assert code0 == 1 and "Traceback" in err0, err0[-3000:]
    assert "OSError: [Errno 5] Input/output error (the test's storage failure)" in err0
    assert code1 == 1, err1[-3000:]
    assert ("maxlm: process 0 failed: OSError: [Errno 5] Input/output error (the test's storage "
            "failure); its own output has the traceback") in err1
    assert "Traceback" not in err1

    homes = [tmp_path / "home0", tmp_path / "home1"]
    for home in homes:
        home.mkdir()
    shutil.copy(sp_model, homes[1] / "tok.model")  # process 1's host has it, process 0's does not
    command = [sys.executable, "-m", "maxlm.train", *train_flags(
        tmp_path / "run_sp", data_dirs, "--config.data.tokenizer=~/tok.model", "--config.model.vocab_size=320")]
    results = two_processes(tmp_path, command, timeout=60,
                            wrap=lambda i, argv: ["env", f"HOME={homes[i]}", *argv])
    for (out, err), code in results:
        assert code == 2, err[-3000:]
        assert f"tokenizer model file not found: {str(homes[0] / 'tok.model')!r}" in err
        assert "Traceback" not in err
    assert not (tmp_path / "run_sp").exists()  # a refused run writes nothing, on any process

    cfg = config_lib.resolve(load_config("tiny"), jax.device_count())
    hf.export(random_params(cfg.model), cfg, str(homes[0] / "hf"))
    command = [sys.executable, "-m", "maxlm.train", *train_flags(
        tmp_path / "run_hf", data_dirs, "--config.checkpoint.init_from_hf=~/hf")]
    results = two_processes(tmp_path, command, timeout=60,
                            wrap=lambda i, argv: ["env", f"HOME={homes[i]}", *argv])
    for (out, err), code in results:
        assert code == 2, err[-3000:]
        assert "checkpoint.init_from_hf=" in err and "cannot be read by process(es) 1 of the job" in err
        assert "Traceback" not in err
    assert not (tmp_path / "run_hf").exists()


HARNESS_TASK = """task: {name}
dataset_path: json
dataset_kwargs: {{data_files: {{test: {data}}}}}
test_split: test
doc_to_text: "{{{{context}}}}"
target_delimiter: ""
"""
HARNESS_KINDS = {
    "mc": """output_type: multiple_choice
doc_to_choice: "{{choices}}"
doc_to_target: "{{answer}}"
metric_list: [{metric: acc, aggregation: mean, higher_is_better: true}]""",
    "gen": """output_type: generate_until
doc_to_target: "{{choices[answer]}}"
generation_kwargs: {until: ["\\\\n"], max_gen_toks: 4}
metric_list: [{metric: exact_match, aggregation: mean, higher_is_better: true}]""",
}


@pytest.mark.ci
def test_harness_on_two_processes_prints_what_one_process_does(tmp_path, data_dirs):
    """`maxlm.eval --harness` on a job of two processes: each runs lm-eval alike (their shared
    Hugging Face cache built by both at once) and they score and generate together on the global
    mesh; process 0 alone prints, and what it prints is the one-process job's output."""
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "maxlm.train", *train_flags(run, data_dirs)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300, env=command_env(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [f"    return self.{name}(x" for name in ("forward", "update", "reset", "close", "flush", "read")]
    (tmp_path / "mc.jsonl").write_text("".join(json.dumps(
        {"context": line, "choices": [")\n", "]\n", " +\n"], "answer": k % 3}) + "\n" for k, line in enumerate(lines)))
    include = tmp_path / "tasks"
    include.mkdir()
    for kind, body in HARNESS_KINDS.items():
        (include / f"{kind}.yaml").write_text(HARNESS_TASK.format(name=kind, data=tmp_path / "mc.jsonl") + body + "\n")
    command = [sys.executable, "-m", "maxlm.eval", f"--workdir={run}", "--harness=mc,gen", f"--harness_include={include}"]
    one = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env=command_env(tmp_path, HF_DATASETS_OFFLINE="1"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert [json.loads(line)["task"] for line in one.stdout.splitlines()] == ["mc", "gen"]
    ((out0, err0), code0), ((out1, err1), code1) = two_processes(tmp_path, command, HF_DATASETS_OFFLINE="1")
    assert code0 == 0 and code1 == 0, (err0 + err1)[-3000:]
    json_lines = lambda out: [line for line in out.splitlines() if line.startswith("{")]  # not gloo's own
    assert json_lines(out0) == json_lines(one.stdout) and json_lines(out1) == []
