"""The keys of how a run trains: the mesh, the optimizer and the checkpoints."""

from __future__ import annotations

from maxlm.config.mesh_axes import DEFAULT_RULES
from maxlm.config.rules import (
    BOOL,
    LR_BATCH_SCALING,
    MESH_SIZE,
    MU_DTYPES,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    OPTIMIZERS,
    POSITIVE,
    POSITIVE_INT,
    SCHEDULES,
    between,
    one_of,
)
from maxlm.config.schema import SAME, Section, key

# The `mesh` section.
MESH = Section()  # each axis's size: -1 = all devices left after the other axes (one axis at most)
MESH.stage = key(1, MESH_SIZE,
              'pipeline parallelism: the scanned layers are split evenly over this many stages with a GPipe '
              'schedule, or a circular one with `model.pipeline_repeats` '
              '([how](architecture.md#pipeline-parallelism)). `model.num_layers` must be divisible by it, and '
              "so must an MoE model's `model.first_dense_layers`; needs `model.scan_layers`; every attention "
              'kernel runs in it ([how](architecture.md#pipeline-parallelism))')
MESH.data = key(1, MESH_SIZE,
             'mesh axis sizes. One of the six axes may be `-1`, meaning all remaining devices. The product of '
             '`stage × data × fsdp × expert × sequence × tensor` must equal the device count')
MESH.fsdp = key(-1, MESH_SIZE, SAME)
MESH.expert = key(1, MESH_SIZE,
               "expert parallelism: an MoE model's experts are split over this many devices and each MoE layer "
               "sends the tokens to their experts' devices and back ([how](moe.md#parallelism)); outside the "
               'MoE layers it is data parallelism (the batch is split over it). `-1` allowed. > 1 needs '
               '`model.num_experts > 0` divisible by it')
MESH.sequence = key(1, MESH_SIZE,
                 'sequence parallelism: activations are split along the length over this many devices '
                 '([how](architecture.md#sequence-parallelism)). `seq_len` must be divisible by it; XLA '
                 'attention only (`auto` becomes `xla`; `cudnn`/`splash` are a config error); its devices must '
                 'lie within one process')
MESH.tensor = key(1, MESH_SIZE, 'see `mesh.data`')
MESH.dcn_data = key(1, POSITIVE_INT,
                 'multi-slice / multi-node: how many granules (TPU slices; on GPU/CPU, processes, one per node '
                 'under SLURM) the `data` / `fsdp` / `expert` axis spans; the rest of each axis lies inside a '
                 'granule. Each must divide `mesh.data` / `mesh.fsdp` / `mesh.expert`, and when any is > 1, '
                 '`dcn_data × dcn_fsdp × dcn_expert` must equal the number of granules. Keep `expert` inside a '
                 "granule where you can: its exchanges are on every MoE layer's critical path ([hybrid "
                 'meshes](launching.md#multi-slice-and-multi-node-meshes))')
MESH.dcn_fsdp = key(1, POSITIVE_INT, SAME)
MESH.dcn_expert = key(1, POSITIVE_INT, SAME)
MESH.rules = key(DEFAULT_RULES, doc='logical axis → mesh axis rules', shown='see [sharding rules](architecture.md#sharding-rules)')


# The `optim` section.
OPTIM = Section()
OPTIM.name = key("adamw", one_of(OPTIMIZERS),
             'the optimizer: `adamw`, `lion`, `adafactor` or `muon` ([which reads '
             'what](architecture.md#optimizers-and-schedules); Muon on the weight matrices and AdamW on the '
             'embeddings, head, norms and biases: [Muon](architecture.md#muon)). A checkpoint resumes only with'
             ' the `optim.name` that wrote it (exit 2 otherwise)')
OPTIM.lr = key(3e-4, POSITIVE, 'peak learning rate, before `lr_batch_scaling`')
OPTIM.schedule = key("cosine", one_of(SCHEDULES),
                 'after the warmup: `cosine`, `linear`, `polynomial`, `step`, `wsd` (warmup-stable-decay), '
                 '`constant` or `inverse_sqrt` ([the formulas and the keys each '
                 'reads](architecture.md#schedules))')
OPTIM.warmup_steps = key(100, NON_NEGATIVE_INT,
                     'linear warmup from 0 to the peak, every schedule (`inverse_sqrt` needs ≥ 1)')
OPTIM.warmup_fraction = key(0.0, between("[0, 1]"),
                        "> 0: the warmup as this share of `steps` instead (the guides' 1–3%: `0.02`), resolved "
                        'to `optim.warmup_steps = round(warmup_fraction × steps)`, at least 1 (recorded so in '
                        '`config.json`). Set beside an `optim.warmup_steps` of another value (both in the '
                        'config file, or both as flags) is exit 2 naming both; a `--config.optim.warmup_fraction`'
                        " flag wins over the config file's `optim.warmup_steps` (`configs/quickstart.py` sets "
                        '30). In [0, 1]; `0` = off')
OPTIM.decay_steps = key(0, NON_NEGATIVE_INT,
                    'the step where the decay ends, counted from step 0 (`0` = `steps`): `cosine`, `linear`, '
                    '`polynomial`, `wsd`')
OPTIM.min_lr_ratio = key(0.1, between("[0, 1]"),
                     "the decay's floor as a fraction of the peak: `cosine`, `linear`, `polynomial`, `wsd`")
OPTIM.power = key(1.0, POSITIVE, "`polynomial`: the decay's exponent (> 0; 1 is `linear`)")
OPTIM.boundaries = key((), doc=(
                   '`step`: the steps where the lr is multiplied by `decay_factor`, strictly increasing ints in'
                   ' (`warmup_steps`, `steps`), e.g. `(600,900)`; set with another schedule, exit 2'))
OPTIM.decay_factor = key(0.1, between("(0, 1)"), '`step`: the factor at each boundary, in (0, 1)')
OPTIM.decay_fraction = key(0.2, between("(0, 1]"),
                       '`wsd`: the share of `decay_steps` spent decaying, at its end, in (0, 1]')
OPTIM.lr_batch_scaling = key("none", one_of(LR_BATCH_SCALING),
                         '`sqrt` or `linear`: the peak is `lr × (batch_size / lr_reference_batch)` to the power'
                         ' 1/2 or 1. The recorded config keeps `lr`; the `optimizer:` log line and the `lr` '
                         'metric show the rate used')
OPTIM.lr_reference_batch = key(0, NON_NEGATIVE_INT, 'the batch size `lr` was tuned at; > 0 with `lr_batch_scaling`')
OPTIM.clip_norm = key(1.0, NON_NEGATIVE, 'global-norm clipping of the gradients before any optimizer (`0` = off)')
OPTIM.weight_decay = key(0.1, NON_NEGATIVE,
                     'decoupled weight decay, multiplied by the learning rate, on matrices only (not norm '
                     "scales), in all four optimizers (Muon: its matrices and its AdamW part's embeddings and "
                     'head)')
OPTIM.b1 = key(0.9, between("[0, 1)"),
           "AdamW's, and Muon's AdamW part's; Lion reads `b1`, `b2` (its usual `b2` is 0.99); Adafactor reads "
           'none')
OPTIM.b2 = key(0.95, between("[0, 1)"), SAME)
OPTIM.eps = key(1e-8, POSITIVE, SAME)
OPTIM.grad_accum_steps = key(1, POSITIVE_INT,
                         'gradient accumulation: the jitted step splits the global batch into this many '
                         'microbatches (a `lax.scan`, losses and gradients weighted by token counts, one '
                         'optimizer update), so activation memory scales with the microbatch; same numbers as '
                         'the large batch. `batch_size` must be divisible by `grad_accum_steps × mesh.data × '
                         'mesh.fsdp`')
OPTIM.shard_state_over_data = key(False, BOOL,
                              "ZeRO-1: the optimizer's moments (Adafactor's factored ones too) are also sharded"
                              ' over `mesh.data` (on their `embed` dim when it divides, otherwise on the first '
                              'dim that does); parameters stay replicated over `data`; same numbers')
OPTIM.mu_dtype = key("float32", one_of(MU_DTYPES),
                 "`bfloat16` stores the first moment of AdamW or Lion, or Muon's momentum and its AdamW part's "
                 "first moment, at half the memory (AdamW's second moment stays float32); Adafactor has none, "
                 'so `bfloat16` with it is exit 2')
OPTIM.muon_momentum = key(0.95, between("[0, 1)"), "`muon`: the momentum β of the matrices' update, in [0, 1)")
OPTIM.muon_nesterov = key(True, BOOL,
                      "`muon`: Nesterov momentum (the matrices' update orthogonalises β·m + (1 − β)·g, not m)")
OPTIM.muon_ns_steps = key(5, POSITIVE_INT, '`muon`: Newton–Schulz iterations per update (a positive int)')
OPTIM.muon_consistent_rms = key(0.2, NON_NEGATIVE,
                            '`muon`: each orthogonalised matrix is scaled by this × √max(fan_in, fan_out), so '
                            "its update's RMS is about AdamW's and `optim.lr` and `weight_decay` carry over "
                            "from an AdamW run (Moonlight's 0.2; MaxText's `muon_consistent_rms`); `0` = Keller"
                            " Jordan's √max(1, fan_out / fan_in) instead, whose usual lr is about 0.02 (then "
                            'set `muon_adam_lr` to the AdamW one)')
OPTIM.muon_adam_lr = key(0.0, NON_NEGATIVE,
                     '`muon`: the peak lr of the AdamW part (embeddings, head, norms, biases), on the same '
                     "schedule and batch scaling as `optim.lr`; `0` = `optim.lr`. The `lr` metric is Muon's")
OPTIM.loss_scale_init = key(2.0**15, POSITIVE,
                        "`model.dtype=float16` only: the dynamic loss scale's starting value (≥ "
                        '`loss_scale_min`)')
OPTIM.loss_scale_growth_interval = key(2000, POSITIVE_INT.described("a positive int (good steps before the loss scale doubles)"),
                                   'consecutive applied steps after which the loss scale doubles')
OPTIM.loss_scale_min = key(1.0, POSITIVE,
                       'an overflow halves the scale, but not below this; a non-finite step at the minimum '
                       'counts as a bad step (`skipped_steps`, `bad_streak`, `checkpoint.max_bad_steps`)')


# The `checkpoint` section.
CHECKPOINT = Section()
CHECKPOINT.every_steps = key(100, POSITIVE_INT, 'save interval; the last step is also saved')
CHECKPOINT.max_to_keep = key(3, POSITIVE_INT, 'newest regular checkpoints kept (the newest committed one is never deleted)')
CHECKPOINT.keep_period = key(0, NON_NEGATIVE_INT, 'also keep every step that is a multiple of this, forever (`0` = off)')
CHECKPOINT.every_minutes = key(0.0, NON_NEGATIVE,
                      'time-based temporary saves, each deleted once a newer one commits, also after a restart '
                      "(the kind is in each checkpoint's meta) (`0` = off)")
CHECKPOINT.max_bad_steps = key(3, POSITIVE_INT,
                      'consecutive non-finite (skipped) steps before restoring the last good checkpoint ([fault'
                      ' tolerance](checkpoints.md#non-finite-steps))')
CHECKPOINT.max_restores = key(2, NON_NEGATIVE_INT,
                     'such restores that do not get past the failure before the run stops (exit 3)')
CHECKPOINT.restore_lr_scale = key(1.0, between("(0, 1]"),
                         'lr multiplier applied at each such restore (recorded in the checkpoint)')
CHECKPOINT.restore_from = key("", doc=(
                     'start an empty workdir from another run: a `checkpoints/STEP` dir, a `checkpoints/` dir '
                     'or a workdir (its newest complete checkpoint)'))
CHECKPOINT.restore_params_only = key(False, BOOL,
                            'with `restore_from`: params only (step 0, fresh optimizer); otherwise the full '
                            'state')
CHECKPOINT.init_from_hf = key("", doc=(
                     'start an empty workdir from a Hugging Face Llama folder, local or `gs://`; cannot be '
                     'combined with `restore_from` ([import](huggingface.md#import))'))
CHECKPOINT.local_dir = key("", doc=(
                  "the host-local tier: a path on each host's own disk (`{process}` in it becomes the process "
                  "index), saved every `local_every_steps` with a replica of a neighbour's shards ([two "
                  'tiers](checkpoints.md#two-tiers)); `""` = off'))
CHECKPOINT.local_every_steps = key(10, POSITIVE_INT, 'local save interval; below `checkpoint.every_steps`')
CHECKPOINT.local_max_to_keep = key(2, POSITIVE_INT,
                          "newest local saves kept on each host (the persistent tier's retention is separate)")
