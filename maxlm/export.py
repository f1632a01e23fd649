"""Export a run's checkpoint for Hugging Face transformers:
`python -m maxlm.export --workdir=DIR --out=HFDIR [--step=N] [--dtype=float32|bfloat16]
[--max_shard_mb=5120]`.

Loads the run like `python -m maxlm.eval` (DIR/config.json, one checkpoint's parameters sharded by
the config's mesh rules; default the newest complete checkpoint) and writes into HFDIR what
`transformers.AutoModelForCausalLM.from_pretrained(HFDIR)` and `AutoTokenizer.from_pretrained(HFDIR)`
load with no custom code: `config.json`, `generation_config.json`, `model.safetensors` (or shards
and an index past --max_shard_mb) and the tokenizer files. The class follows from the run's config
(`LlamaForCausalLM`, `Qwen3ForCausalLM`, `MixtralForCausalLM`, `Qwen3MoeForCausalLM`:
`maxlm/hf/architectures.py`), the weights' mapping is in `maxlm/hf/mapping.py`, the files in
`maxlm/hf/files.py`; the way back is the config key `checkpoint.init_from_hf=HFDIR`. A run the
class cannot hold (`model.positions` other than `rope`, an MoE key the class has no place for) is
refused with one line naming the key (exit 2), from the run's config.json before its checkpoint is
read. Prints one JSON object: out, step, dtype, files, checkpoint.
"""

from __future__ import annotations

import json

import jax

from maxlm import cli
from maxlm.checkpoint import saved_run
from maxlm.hf import files as hf
from maxlm.runtime import distributed


def main(argv) -> None:
    f = cli.start(argv, required=("workdir", "out"))
    if f.dtype not in hf.DTYPES:
        cli.config_error(f"--dtype={f.dtype!r}: expected one of {', '.join(hf.DTYPES)}")
    if f.max_shard_mb < 1:
        cli.config_error(f"--max_shard_mb={f.max_shard_mb} must be >= 1")
    distributed.initialize()
    try:
        hf.architecture(saved_run.read_config(f.workdir).model, "the Hugging Face export")  # before restoring
        run = saved_run.load_run(f.workdir, f.step)
        files = hf.export(run["params"], run["config"], f.out, f.dtype, f.max_shard_mb * 2**20)
    except ValueError as e:  # RunError, ConfigError, a missing tokenizer file
        cli.config_error(str(e))
    if jax.process_index() == 0:
        print(json.dumps({"out": f.out, "step": run["step"], "dtype": f.dtype, "files": files,
                          "checkpoint": run["path"]}), flush=True)


def define_flags() -> None:
    from absl import flags

    flags.DEFINE_string("workdir", None, "A training run's workdir (config.json, checkpoints/).")
    flags.DEFINE_string("out", None, "Local directory to write the Hugging Face model into.")
    flags.DEFINE_integer("step", None, "Checkpoint step (default: the newest complete one).")
    flags.DEFINE_string("dtype", "float32", "Weights' dtype in the export: float32 or bfloat16.")
    flags.DEFINE_integer("max_shard_mb", hf.DEFAULT_MAX_SHARD_BYTES // 2**20,
                         "Split the weights into files of at most this many MiB.")


if __name__ == "__main__":
    cli.run(main, define_flags, config_file=False)
