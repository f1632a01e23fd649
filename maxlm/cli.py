"""What every command shares: absl flags with an ml_collections `--config` file, the XLA:CPU
default, and the exit status of a user error.

Every user error — a bad flag, an unknown `--config.KEY`, a config file that does not load, a
value that fails validation, a `maxlm.runtime.errors.UserError` raised anywhere below — ends the same way:
one line on stderr and exit status 2, no traceback. A process of a job that stops because process 0
failed (`maxlm.runtime.processes.ProcessFailed`) ends with one line and exit status 1: process 0 prints the
traceback. Only commands import this module; the library
raises, and warns through maxlm/runtime/console.py.

Before a command runs, `run` sets one XLA flag for the *CPU* backend (accelerators ignore `xla_cpu_*`
flags; XLA reads XLA_FLAGS when the first backend starts, so importing JAX before is fine): matmuls
and reductions run as YNNPACK fusions (`--xla_cpu_experimental_ynn_fusion_type=dot,reduce`), faster
than XLA:CPU's own code (the figures: docs/performance.md#the-cpu-xla-flag). Elementwise fusions
(`eltwise`) are left out: XLA emits YNN elementwise fusions for operands with non-default layouts,
which it then rejects at run time ("Instruction with unsupported layout in YNN fusion"). `MAXLM_XLA_CPU_DEFAULTS=0` turns the flag off; a value already in
XLA_FLAGS wins; other jaxlib series don't get it (XLA aborts on flags it does not know). Importing
maxlm changes no environment variable.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import sys
from typing import Callable, NoReturn

from maxlm.runtime.errors import UserError
from maxlm.runtime.processes import ProcessFailed

# XLA_FLAGS as the environment gave them, before `set_xla_cpu_defaults` adds maxlm's (bench
# compare passes these, not maxlm's, to the code it compares with).
USER_XLA_FLAGS = os.environ.get("XLA_FLAGS", "")
CPU_FLAG = "--xla_cpu_experimental_ynn_fusion_type"
CPU_DEFAULT = f"{CPU_FLAG}=dot,reduce"
# XLA aborts on a flag it does not know, and experimental flags come and go: only for the jaxlib
# series it was measured with (docs/performance.md#the-cpu-xla-flag).
TESTED_JAXLIB = ("0.10.", "0.12.")


def set_xla_cpu_defaults() -> None:
    """Adds `CPU_DEFAULT` to XLA_FLAGS unless turned off, already set, or jaxlib is untested.
    Call before the first JAX backend starts."""
    try:
        jaxlib = importlib.metadata.version("jaxlib")
    except importlib.metadata.PackageNotFoundError:
        jaxlib = ""
    if (os.environ.get("MAXLM_XLA_CPU_DEFAULTS", "1") != "0"
            and CPU_FLAG not in os.environ.get("XLA_FLAGS", "")
            and jaxlib.startswith(TESTED_JAXLIB)):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {CPU_DEFAULT}".strip()


def config_error(message: str) -> NoReturn:
    print(f"maxlm: config error: {message}", file=sys.stderr)
    sys.exit(2)


HELP_FLAGS = ("--help", "-h", "-?", "--helpshort", "--helpfull", "--helpxml")


def parse_flags(argv: list[str]) -> list[str]:
    """absl's flag parser, every failure turned into `config_error`."""
    from absl import flags

    try:
        return flags.FLAGS(argv)
    except SystemExit as e:  # absl's --help ends the process with status 1: asking for help is no failure
        if e.code == 1 and any(a in HELP_FLAGS for a in argv[1:]):
            sys.exit(0)
        raise
    except flags.Error as e:  # a config file that raised comes as its whole traceback: its last line
        lines = [line for line in str(e).splitlines() if line.strip()]
        config_error(lines[0] if len(lines) == 1 else f"{lines[0].split(': ')[0]}: {lines[-1].strip()}")
    except Exception as e:  # raised while loading the config file or applying a --config.KEY
        config_error(flag_error_message(argv, e))


def flag_error_message(argv: list[str], error: Exception) -> str:
    """One line for a config file or a --config.KEY flag that could not be applied: the unknown
    key with its nearest known one, the file without get_config(), or the file's own error."""
    from maxlm import config as config_lib
    from maxlm.config import schema

    known = list(config_lib.declared())
    for arg in argv[1:]:
        name = arg.removeprefix("--config.").split("=", 1)[0]
        if arg.startswith("--config.") and name not in known and not any(name.startswith(k + ".") for k in known):
            return schema.unknown_key_message(name, known)
    cause = error.__cause__ or error
    path = next((a.split("=", 1)[1] for a in argv[1:] if a.startswith("--config=")), "the config file")
    if "has no attribute 'get_config'" in str(cause):
        return f"{path} defines no get_config(), which a config file must (configs/tiny.py is one)"
    return f"{path}: {type(cause).__name__}: {' '.join(str(cause).split())}"


def setup_logging() -> None:
    """Short log lines (time + message) instead of absl's long prefix."""
    from absl import logging as absl_logging

    absl_logging.set_verbosity(absl_logging.WARNING)  # orbax and grain log chattily via absl
    logging.getLogger("maxlm").setLevel(logging.INFO)
    absl_logging.get_absl_handler().setFormatter(
        logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S")
    )
    logging.getLogger("jax._src.xla_bridge").setLevel(logging.WARNING)  # "no TPU found" noise


def run(main: Callable[[list[str]], None], define_flags: Callable[[], None],
        config_file: bool = True) -> None:
    """Defines `--config` (unless not `config_file`) plus `define_flags()`'s flags, parses them,
    and runs `main(argv)` with the XLA:CPU default set; a UserError from it ends as exit 2, and
    ProcessFailed (process 0's failure, on another process) as one line and exit 1."""
    from absl import app

    set_xla_cpu_defaults()
    skip_absent_accelerators()

    def guarded(argv):
        try:
            return main(argv)
        except UserError as e:
            config_error(str(e))
        except ProcessFailed as e:
            print(f"maxlm: {e}", file=sys.stderr)
            sys.exit(1)

    if config_file:
        from ml_collections import config_flags

        config_flags.DEFINE_config_file("config", None, "Path to a configs/*.py file; --config.KEY=VALUE overrides "
                                        "any key (docs/config.md).", lock_config=True)
    define_flags()
    if config_file:  # --help lists the command's own flags: --config is one of them, defined here
        from absl import flags

        flags.FLAGS.register_key_flag_for_module(sys.argv[0], flags.FLAGS["config"])
    app.run(guarded, flags_parser=parse_flags)


def skip_absent_accelerators() -> None:
    """JAX_PLATFORMS=cpu where no accelerator can be present (maxlm/runtime/platforms.py), so an
    installed libtpu or CUDA plugin prints none of its errors off its hardware. A JAX_PLATFORMS
    the user set wins."""
    from maxlm.runtime import platforms

    if "JAX_PLATFORMS" not in os.environ and platforms.cpu_only():
        os.environ["JAX_PLATFORMS"] = "cpu"  # for the processes a command starts
        import jax  # JAX reads the variable when it is imported, maybe already

        jax.config.update("jax_platforms", "cpu")


def start(argv: list[str], required: tuple[str, ...] = ()):
    """The start of every command's `main`: no stray positional arguments, short log lines, the
    `required` flags given (else exit 2). Returns the parsed flags."""
    from absl import flags

    if len(argv) > 1:
        config_error(f"unexpected arguments {argv[1:]}")
    setup_logging()
    missing = [f"--{name}" for name in required if not flags.FLAGS[name].value]
    if missing:
        config_error(" and ".join(missing) + (" is" if len(missing) == 1 else " are") + " required")
    workdir = flags.FLAGS["workdir"].value if "workdir" in flags.FLAGS else None
    if workdir and str(workdir).startswith("gs://"):
        from maxlm.runtime import gcs

        gcs.check_reachable(str(workdir))  # a UserError: exit 2, one line
        gcs.check_access(str(workdir))  # the same: no credentials, no access, no bucket
    return flags.FLAGS


def resolved_config(num_devices: int, num_granules: int | None = None, platform: str | None = None):
    """The parsed `--config`, validated for `num_devices` in `num_granules` TPU slices or
    processes (default: those of `jax.devices()`, for `mesh.dcn_*`) and for `platform` (default:
    the one JAX runs on; checked against the config's `platform`) (exit 2 on a problem)."""
    import jax
    from absl import flags

    from maxlm import config as config_lib
    from maxlm.sharding import mesh as mesh_lib

    if num_granules is None:
        num_granules = mesh_lib.num_granules()

    try:
        config = flags.FLAGS.config
        if config is None:
            config_error("--config=configs/NAME.py is required")
        config.to_dict()  # a config file that failed to load raises only when read
    except OSError as e:
        config_error(" ".join(str(e).split()))
    except Exception as e:  # the file's own get_config() failed (a wrong type: `c.steps = 8.5`)
        config_error(flag_error_message(sys.argv, e))
    if config.model.from_hf:
        from maxlm.hf import files as hf_files

        try:
            taken = hf_files.take_model_keys(config)
        except config_lib.ConfigError as e:
            config_error(str(e))
        logging.getLogger("maxlm").info("model keys from %s/config.json: %s", config.checkpoint.init_from_hf,
                                        ", ".join(f"model.{k}={v!r}" for k, v in taken.items()))
    try:  # the config as the file made it, with what the file and the flags assigned recorded
        return config_lib.resolve(config, num_devices, num_granules, platform=platform or jax.default_backend(),
                                  flags=flags.FLAGS["config"].override_values)
    except config_lib.ConfigError as e:
        config_error(str(e))


def use_compile_cache(cfg) -> None:
    """JAX's persistent compilation cache in `cfg.compile_cache_dir`, when set, for every program
    however quick to compile (a restart should compile nothing it compiled before).

    Off on several CPU devices, whoever asked for it: XLA:CPU deserializes a while
    loop's body (the scanned layers) with a collective-ordering resource of its own, so an
    executable loaded from the cache no longer orders the loop's collectives against the ones
    outside it; the devices then enter them in different orders and wait until XLA aborts the
    process ("Termination timeout"). A compiled executable keeps one order (docs/testing.md)."""
    import jax

    from maxlm.runtime import console, paths

    if jax.default_backend() == "cpu" and jax.device_count() > 1:
        if cfg.compile_cache_dir or jax.config.jax_compilation_cache_dir:
            console.warn(f"the compilation cache is off on {jax.device_count()} CPU devices: XLA:CPU loses the "
                 "order of the collectives of an executable it loads from it (docs/testing.md)")
        jax.config.update("jax_enable_compilation_cache", False)
        return
    if cfg.compile_cache_dir:
        path = cfg.compile_cache_dir
        jax.config.update("jax_compilation_cache_dir", path if paths.is_remote(path) else os.path.expanduser(path))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)