"""The config's declarations (maxlm/config/schema.py, *_keys.py): every key typed, in a domain and
described; docs/config.md's table written from them; what the user set counts as set; types held
on the way back from config.json; a typo in a config file refused."""

import json
import subprocess
import sys

import pytest

from maxlm import config as config_lib
from maxlm.config import reference, rules, schema
from tests.helpers import ROOT, command_env, load_config, with_overrides


def test_docs_config_md_is_what_the_declarations_write():
    assert reference.current() == reference.table(), "run `python -m maxlm.config.reference`"


def test_every_key_is_typed_and_described():
    declared = config_lib.declared()
    assert len(declared) > 150
    assert [n for n, k in declared.items() if not k.doc] == []
    for name, k in declared.items():
        assert isinstance(k.default, k.type) or (k.type is float and type(k.default) is int), name


@pytest.mark.parametrize("args, message", [
    ((8, rules.POSITIVE, "a count"), "is a int, but its domain 'a positive finite number' holds floats"),
    ((8.0, rules.POSITIVE_INT, "a count"), "is a float, but its domain 'a positive int' holds ints"),
    ((8,), "needs its one-line doc"),
    ((8, None, "a count"), "needs a domain"),
])
def test_a_declaration_without_its_type_domain_or_doc_is_refused(args, message):
    with pytest.raises(TypeError, match=message):
        schema.key(*args)


def test_the_counts_are_ints():
    """The counts the issue named: a float is no longer a valid batch size."""
    for name in ("steps", "batch_size", "seq_len", "model.num_layers", "checkpoint.max_to_keep"):
        assert config_lib.declared()[name].type is int, name
    recorded = load_config("tiny").to_dict()
    recorded["steps"] = 8.0
    with pytest.raises(config_lib.ConfigError, match=r"^steps must be a positive int, got 8\.0$"):
        config_lib.resolve(config_lib.ml_collections.ConfigDict(recorded), 8)


def test_a_config_json_read_back_is_checked_against_the_types():
    recorded = json.loads(json.dumps(config_lib.resolve(load_config("tiny"), 8).to_dict()))
    recorded["model"]["num_layers"] = "2"
    with pytest.raises(config_lib.ConfigError, match=r"^the recorded model.num_layers='2' is not a positive int$"):
        config_lib.from_recorded(recorded)


def test_what_the_user_set_counts_whatever_its_value():
    """batch_size=8 is the default, and still a value the user gave (issue 53: it was dropped)."""
    both = with_overrides(load_config("tiny"), {"batch_size": 8, "batch_tokens": 4096})
    with pytest.raises(config_lib.ConfigError, match=r"batch_tokens=4096 \(= 64 sequences of seq_len=64\) and "
                                                     r"batch_size=8 are both set"):
        config_lib.resolve(both, 8)
    # the file (configs/tiny.py) sets batch_size; a flag's batch_tokens wins over it
    flag = with_overrides(load_config("tiny"), {"batch_tokens": 4096})
    assert config_lib.resolve(flag, 8, flags=["batch_tokens"]).batch_size == 64
    with pytest.raises(config_lib.ConfigError, match="both set"):  # ... but not when both come from the file
        config_lib.resolve(flag, 8)
    assert "batch_size" in schema.assigned_keys(load_config("tiny"))
    assert schema.assigned_keys(config_lib.from_recorded({})) is None  # read back: not known


def test_a_recording_config_pickles_and_copies_to_a_plain_one():
    import copy
    import pickle

    c = load_config("tiny")
    for twin in (pickle.loads(pickle.dumps(c)), copy.deepcopy(c)):
        assert type(twin) is config_lib.ml_collections.ConfigDict and twin.to_dict() == c.to_dict()
        assert schema.assigned_keys(twin) is None


def cli(tmp_path, *flags):
    return subprocess.run([sys.executable, "-m", "maxlm.train", f"--workdir={tmp_path / 'run'}", *flags], cwd=ROOT,
                          env=command_env(tmp_path, devices=None), capture_output=True, text=True, timeout=300)


def test_a_typo_in_a_config_file_is_exit_2_naming_the_nearest_key(tmp_path):
    """Issue 54: `c.optim.lrr = 1e-3` in a config file trained on the default lr, and config.json kept it."""
    path = tmp_path / "typo.py"
    path.write_text("from maxlm import config\n\ndef get_config():\n    c = config.defaults()\n"
                    "    c.optim.lrr = 1e-3\n    return c\n")
    done = cli(tmp_path, f"--config={path}")
    assert done.returncode == 2 and not (tmp_path / "run").exists()
    assert done.stderr.strip().splitlines() == ["maxlm: config error: unknown config key optim.lrr: did you mean optim.lr?"]


def test_the_user_set_rule_through_the_command_line(tmp_path):
    done = cli(tmp_path, "--config=configs/tiny.py", "--config.batch_size=8", "--config.batch_tokens=4096")
    assert done.returncode == 2 and "batch_tokens=4096 (= 64 sequences of seq_len=64) and batch_size=8 are both set" \
        in done.stderr, done.stderr


@pytest.mark.parametrize("file, flags, line", [
    ("    c.steps = 8.5\n", (), "TypeError: Could not override field 'steps' (reference). 8.5 is of original type "
                                "<class 'float'> and cannot be casted to type <class 'int'>"),
    (None, (), "defines no get_config(), which a config file must (configs/tiny.py is one)"),
    ("", ("--config.optim.lrr=1",), "unknown config key optim.lrr: did you mean optim.lr?"),
])
def test_a_bad_config_file_or_flag_is_one_line(tmp_path, file, flags, line):
    """Issue 54: a wrong type in a file printed ml_collections' traceback, a file without get_config
    was an 'unknown config key', and an unknown flag key printed a KeyError's repr and the argv."""
    path = tmp_path / "c.py"
    path.write_text("x = 1\n" if file is None else
                    f"from maxlm import config\n\ndef get_config():\n    c = config.defaults()\n{file}    return c\n")
    done = cli(tmp_path, f"--config={path}", *flags)
    assert done.returncode == 2 and not (tmp_path / "run").exists()
    [got] = done.stderr.strip().splitlines()
    assert got.startswith("maxlm: config error: ") and got.endswith(line), got


@pytest.mark.parametrize("command, flag", [("train", "--config"), ("train", "--workdir"), ("eval", "--workdir"),
                                           ("generate", "--prompt"), ("data", "--config")])
def test_help_lists_the_commands_flags_and_exits_0(tmp_path, command, flag):
    """Issue 54: `train --help` listed only --workdir (--config is defined in cli.py), and exited 1."""
    done = subprocess.run([sys.executable, "-m", f"maxlm.{command}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env=command_env(tmp_path, devices=None))
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"  {flag}:" in done.stdout + done.stderr
