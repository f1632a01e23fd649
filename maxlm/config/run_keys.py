"""The run's own keys (steps, batch, seed, platform, ...) and the sections of what it does beside
training: fault injection, loss-spike recovery, eval, metrics, the monitor, profiling."""

from __future__ import annotations

from maxlm.config import data_keys, model_keys, train_keys
from maxlm.config.rules import (
    BOOL,
    INT_OR_OFF,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    PLATFORMS,
    POSITIVE,
    POSITIVE_INT,
    between,
    one_of,
)
from maxlm.config.schema import SAME, Section, key

# Every key a run reads, declared in order: the sections of the other modules included.
RUN = Section()
RUN.name = key("default", doc='a label, carried into metrics and benchmarks')
RUN.seed = key(0, NON_NEGATIVE_INT, 'parameter init and data order')
RUN.steps = key(1000, POSITIVE_INT, 'total training steps (a resumed run stops here too)')
RUN.batch_size = key(8, POSITIVE_INT,
                   '**global** batch, in sequences; divisible by `mesh.data × mesh.fsdp × mesh.expert` (× '
                   '`optim.grad_accum_steps`, × `model.pipeline_microbatches`)')
RUN.batch_tokens = key(0, NON_NEGATIVE_INT,
                     "> 0: the global batch in tokens instead (the guides' unit), resolved to `batch_size = "
                     'batch_tokens / seq_len` sequences (recorded so in `config.json`), to which every '
                     '`batch_size` rule then applies; not a multiple of `seq_len`: exit 2. Set beside a '
                     '`batch_size` of another value (both in the config file, or both as flags, whatever '
                     'the value) is exit 2 naming both; a `--config.batch_tokens` flag wins over the config '
                     "file's `batch_size`. `0` = off")
RUN.seq_len = key(256, POSITIVE_INT, 'tokens per sequence')
RUN.log_every_steps = key(10, POSITIVE_INT, 'how often a training row goes to `metrics.jsonl` and the console')
RUN.platform = key("", one_of(PLATFORMS),
                 '`cpu`, `gpu` or `tpu`: exit 2 unless JAX runs there (`""`: wherever it runs). '
                 '`launch/gpu_host.sh` and `launch/slurm.sbatch` set `gpu` (`MAXLM_PLATFORM` overrides it), '
                 '`launch/tpu.py` sets `tpu`, so a job whose jax cannot see its accelerator stops at once '
                 'instead of training on the CPU. Not checked when a run is read back (`maxlm.eval`, '
                 '`generate`, `export`)')
RUN.num_devices = key(0, NON_NEGATIVE_INT,
                    '> 0: exit 2 unless JAX sees exactly this many devices, all processes together (`0`: any)')
RUN.compile_cache_dir = key("", doc=(
                          "JAX's persistent compilation cache for `maxlm.train`: a restart or requeue loads the"
                          ' compiled step instead of compiling it again (tested: the second start of the tiny '
                          "run loads its train step from the cache, per JAX's log of cache hits; the time that "
                          "saves depends on the machine's load: 1.95 s → 1.05 s on a loaded 2-core CPU); every "
                          'program is cached however quick its compile. A local path, or a `gs://` URL through '
                          'JAX\'s own cache (not tested here). `""`: JAX\'s own setting '
                          '(`JAX_COMPILATION_CACHE_DIR`, else off). Off, with a warning, on several CPU '
                          "devices, where XLA:CPU deadlocks in a loaded executable's collectives "
                          '([testing.md](testing.md#failures-that-came-and-went-and-their-causes))'))

RUN.mesh = train_keys.MESH
RUN.model = model_keys.MODEL
RUN.optim = train_keys.OPTIM
RUN.data = data_keys.DATA
RUN.checkpoint = train_keys.CHECKPOINT

RUN.debug = Section()
RUN.debug.nan_at_step = key(-1, INT_OR_OFF.described("a step >= 0 or -1 (off)"),
                          "fault injection: step N's gradients are NaN (`-1` = off). Under float16 that is an "
                          'overflow (the scale halves; it is a bad step only at `optim.loss_scale_min`)')
RUN.debug.nan_steps = key(1, POSITIVE_INT,
                        'inject into that many consecutive steps; only the first time they run in the process '
                        '(`False`: on every replay too)')
RUN.debug.nan_transient = key(True, BOOL, SAME)
RUN.debug.spike_at_batch = key(-1, INT_OR_OFF.described("a data position >= 0 or -1 (off)"),
                             'fault injection: the batch at this data position (and the next '
                             '`debug.spike_batches - 1`) trains with the lr times `debug.spike_lr_scale`, a '
                             'loss spike tied to the data, so a rollback that skips it does not meet it again '
                             '(`-1` = off)')
RUN.debug.spike_batches = key(1, POSITIVE_INT, 'see `debug.spike_at_batch`')
RUN.debug.spike_lr_scale = key(1000.0, POSITIVE, SAME)

RUN.anomaly = Section()  # loss-spike recovery (maxlm/resilience/anomaly.py), off by default
RUN.anomaly.enabled = key(False, BOOL, 'loss-spike recovery ([loss spikes](checkpoints.md#loss-spikes))')
RUN.anomaly.warmup = key(100, NON_NEGATIVE_INT,
                       'losses folded into the running statistics before spikes are looked for')
RUN.anomaly.ema = key(0.99, between("(0, 1)"), 'decay of the running mean and variance of the loss, in (0, 1)')
RUN.anomaly.spike_sigma = key(6.0, POSITIVE, 'a spike: a loss above mean + `spike_sigma` × deviation')
RUN.anomaly.max_spikes = key(3, POSITIVE_INT, 'consecutive spikes that trigger a rollback')
RUN.anomaly.skip_batches = key(200, POSITIVE_INT,
                             'batches skipped from the restored step on; at least enough to pass the last spike')
RUN.anomaly.max_rollbacks = key(3, NON_NEGATIVE_INT,
                              'rollbacks without a checkpoint saved past the spike before the run stops (exit '
                              '3)')

RUN.eval = Section()
RUN.eval.every_steps = key(100, NON_NEGATIVE_INT,
                         'held-out eval interval (`0` = off); eval also runs at the last step')
RUN.eval.steps = key(4, POSITIVE_INT,
                   'validation batches per eval, at most one pass over the split (a row is never counted twice)')
RUN.eval.sets = key((), doc=(
                  'more held-out sets, `((name, source), ...)`, each evaluated at every eval and logged as '
                  '`eval/<name>/loss` and `eval/<name>/perplexity`; a name is an identifier, used once ([named '
                  'eval sets](using-a-run.md#named-eval-sets): which documents a source gives)'))
RUN.eval.tasks = key((), doc=(
                   'task `.jsonl` files (local or `gs://`) scored at every eval, logged as `eval/<stem>/acc`, '
                   '... ([tasks](using-a-run.md#tasks-zero--and-few-shot-scoring)); stems differ from each '
                   'other and from `eval.sets` names'))
RUN.eval.task_shots = key(0, NON_NEGATIVE_INT, 'few-shot examples before each task example (drawn with `seed`)')
RUN.eval.position_buckets = key(8, NON_NEGATIVE_INT,
                              'the validation loss by position in the document, in this many equal spans of '
                              '`seq_len` (at most `seq_len`), logged as `eval/loss_by_position/START` '
                              '([metrics](observability.md#metrics)); `0` = off')

RUN.metrics = Section()
RUN.metrics.tensorboard = key(True, BOOL, 'write TensorBoard event files')
RUN.metrics.wandb = key(False, BOOL,
                      'log the rows and the config to a Weights & Biases run too '
                      '([writers](observability.md#writers)); needs the optional `wandb` package (`make '
                      'install-wandb`), else the run exits 2 before it writes anything')
RUN.metrics.wandb_project = key("maxlm", doc=(
                              'the W&B project (1 to 128 characters, none of `/ \\ # ? % :`) and team or user '
                              "(`''`: the API key's default)"))
RUN.metrics.wandb_entity = key("", doc=SAME)
RUN.metrics.wandb_run_id = key("", doc=(
                             "the W&B run's id; `''`: the one made at the workdir's first start and kept in "
                             '`DIR/wandb_run_id`, so every resume continues the same W&B run'))

RUN.monitor = Section()
RUN.monitor.enabled = key(True, BOOL,
                        "watch the guides' ranges below on each training row, read one step late (no device "
                        'sync): a warning and a `monitor/<name>_out_of_range` marker when a quantity stays '
                        "outside its range ([the guides' ranges](observability.md#the-guides-ranges-watched)); "
                        '`False`: no watch. A bound of `0` is none, and a watch with neither bound is off')
RUN.monitor.patience = key(5, POSITIVE_INT,
                         'consecutive logged rows (`log_every_steps` apart) outside a range before its warning;'
                         ' one warning per excursion, and a line when it is back')
RUN.monitor.grad_norm_low = key(0.5, NON_NEGATIVE,
                              "`grad_norm`'s range after the warmup (the guides' 0.5–2); low below high")
RUN.monitor.grad_norm_high = key(2.0, NON_NEGATIVE, SAME)
RUN.monitor.update_ratio_low = key(1e-4, NON_NEGATIVE,
                                 "`update_ratio`'s range after the warmup: ‖update‖ / ‖params‖ of a step, about"
                                 ' 4–12 × lr with AdamW ([which '
                                 'ratio](observability.md#the-updateparameter-ratio-which-one)); low below high')
RUN.monitor.update_ratio_high = key(3e-2, NON_NEGATIVE, SAME)
RUN.monitor.memory_high = key(0.95, between("[0, 1]"),
                            "the peak memory's share of the device's (`memory_peak_fraction`) above which to "
                            'warn; GPU and TPU (the CPU reports none), in [0, 1]')
RUN.monitor.mfu_low = key(0.2, between("[0, 1]"), 'the MFU below which to warn; GPU and TPU only, in [0, 1]')

RUN.profile = Section()  # a jax.profiler trace of a few steps (maxlm/observe/profiler.py)
RUN.profile.start_step = key(5, NON_NEGATIVE_INT,
                           'the first traced step (an int ≥ 0; [profiling](observability.md#profiling))')
RUN.profile.num_steps = key(0, NON_NEGATIVE_INT,
                          'how many steps to trace with `jax.profiler` into `DIR/profile/` (`0` = off; an int ≥'
                          ' 0)')
