"""The `model.*` keys: the Transformer's shape, its blocks' family choices, attention, MoE, MTP."""

from __future__ import annotations

from maxlm.config.rules import (
    ATTENTION,
    ATTENTION_KINDS,
    BOOL,
    CONTEXT_PARALLEL,
    DTYPES,
    EXPERT_DISPATCH,
    GROUPED_MATMUL,
    LOAD_BALANCE,
    MLP_ACTIVATIONS,
    NON_NEGATIVE,
    NON_NEGATIVE_INT,
    NORM_PLACEMENTS,
    NORMS,
    POSITIONS,
    POSITIVE,
    POSITIVE_INT,
    QK_NORMS,
    REMAT,
    ROPE_SCALINGS,
    ROUTERS,
    between,
    one_of,
)
from maxlm.config.schema import SAME, Section, key

# The `model` section.
MODEL = Section()
MODEL.from_hf = key(False, BOOL,
                    "take the model's keys from `checkpoint.init_from_hf`'s config.json instead of the config's "
                    "(each one it sets is printed at start); a folder holding what maxlm's model cannot "
                    "represent is exit 2 ([import](huggingface.md#import))")
MODEL.num_layers = key(4, POSITIVE_INT, '`num_heads % num_kv_heads == 0` (grouped-query attention)')
MODEL.d_model = key(256, POSITIVE_INT, SAME)
MODEL.num_heads = key(4, POSITIVE_INT, SAME)
MODEL.num_kv_heads = key(4, POSITIVE_INT, SAME)
MODEL.head_dim = key(0, NON_NEGATIVE_INT, '`0` = `d_model // num_heads`; must be even with `model.positions=rope`')
MODEL.mlp_dim = key(768, POSITIVE_INT, 'SwiGLU hidden size')
MODEL.vocab_size = key(384, POSITIVE_INT, "must be ≥ the tokenizer's vocabulary")
MODEL.tie_embeddings = key(False, BOOL, 'share the embedding with the output head')
MODEL.rope_theta = key(10000.0, POSITIVE, "RoPE's base (used with `model.positions=rope` only)")
MODEL.positions = key("rope", one_of(POSITIONS),
                  "how the model sees a token's position in its document (packed documents each count from 0): "
                  '`rope` (rotary embeddings of queries and keys in attention, relative), `sinusoidal` (the '
                  "original Transformer's fixed sin/cos, added to the token embeddings; `d_model` must be even)"
                  ' or `learned` (a `[max_positions, d_model]` parameter table added to the token embeddings, '
                  "sharded like the token embedding's embed dim; its rows follow the `positions` rule, whole by"
                  ' default). Only `rope` exports to Hugging Face or starts from `checkpoint.init_from_hf` '
                  '([position encodings](architecture.md#position-encodings))')
MODEL.rope_scaling = key("none", one_of(ROPE_SCALINGS),
                     "RoPE scaling for context extension: `none` (theta's frequencies), `linear` (every "
                     "frequency divided by the factor: Gemma 3's global layers), `llama3` (Llama 3.1's rule) or"
                     ' `yarn` (YaRN, with its attention factor 0.1·ln(factor) + 1 on cos and sin), as '
                     'transformers computes them; needs `model.positions=rope` ([RoPE '
                     'scaling](architecture.md#rope-scaling); the resume that extends the context: '
                     '[checkpoints](checkpoints.md#extending-the-context))')
MODEL.rope_scaling_factor = key(0.0, NON_NEGATIVE,
                            'with a scaling, `> 1`: how many times the original length the context grows '
                            "(transformers' `factor`); `0` without one")
MODEL.rope_original_max_len = key(0, NON_NEGATIVE_INT,
                              'with `llama3` or `yarn`, required: the `seq_len` the model was trained at before'
                              ' (`original_max_position_embeddings`); `0` without one')
MODEL.rope_low_freq_factor = key(1.0, POSITIVE,
                             '`llama3`: wavelengths longer than original / low are divided by the factor, those'
                             ' shorter than original / high kept, those between blended (`low_freq_factor`, '
                             '`high_freq_factor`; high > low)')
MODEL.rope_high_freq_factor = key(4.0, POSITIVE, SAME)
MODEL.rope_beta_fast = key(32.0, POSITIVE,
                       '`yarn`: dimensions turning more than `beta_fast` times over the original length are '
                       'kept, fewer than `beta_slow` times divided by the factor, a linear ramp between '
                       '(`beta_fast`, `beta_slow`; fast > slow)')
MODEL.rope_beta_slow = key(1.0, POSITIVE, SAME)
MODEL.max_positions = key(0, NON_NEGATIVE_INT,
                      "`learned` only: the table's rows, the longest document position the model can encode "
                      '(`0` = `seq_len`; `seq_len` above it is a config error, and so is generating past it)')
MODEL.norm_eps = key(1e-5, POSITIVE, 'see `model.rope_theta`')
MODEL.norm_placement = key("pre", one_of(NORM_PLACEMENTS),
                       "where each block's RMSNorms sit: `pre` (before each sublayer: Llama, Qwen3, Mixtral), "
                       "`post` (on each sublayer's output, before the residual add: OLMo 2) or `sandwich` "
                       '(both: Gemma 2/3) ([how](architecture.md#norm-placement); [families](models.md))')
MODEL.norm = key("rmsnorm", one_of(NORMS),
             "the blocks' and the final norm: `rmsnorm`, or `layernorm` (centred, with a learned bias: GPT-2); "
             'qk-norm is always RMSNorm')
MODEL.norm_plus_one = key(False, BOOL,
                      "every RMSNorm (the blocks', the final one, qk-norm) scales by 1 + w, its parameter w "
                      "stored and initialised at 0 (Gemma's); not with `model.norm=layernorm` ([Gemma's "
                      'pieces](architecture.md#gemmas-pieces))')
MODEL.scale_embeddings = key(False, BOOL,
                         "the token embeddings times √`d_model` (Gemma's; the head, tied or not, is unscaled)")
MODEL.mlp_activation = key("swiglu", one_of(MLP_ACTIVATIONS),
                       'the dense MLP: `swiglu` (SiLU-gated: Llama, Qwen, Mistral, OLMo), `geglu` '
                       '(tanh-GeLU-gated: Gemma) or `gelu` (ungated tanh GeLU, two matrices: GPT-2). MoE '
                       'experts are SwiGLU: other values exit 2 with `model.num_experts`')
MODEL.use_bias = key(False, BOOL,
                 "biases in every projection: query, key, value, attention output, and the MLP's (GPT-2); not "
                 'with `model.num_experts`. Biases take no weight decay')
MODEL.qkv_bias = key(False, BOOL, 'biases in the query, key and value projections only (Qwen2)')
MODEL.sliding_window = key(0, NON_NEGATIVE_INT,
                       '> 0: each token attends to itself and the `sliding_window - 1` tokens before it in its '
                       'document (Mistral; `0`: the whole causal prefix). Below `seq_len` (at or above it, it '
                       "would hide nothing: exit 2; a checkpoint's such window, Mistral 7B v0.1's 4096 at "
                       '`seq_len=4096`, imports as none). Splash and cuDNN skip the tiles outside the window, '
                       "XLA computes a band, the ring's XLA blocks skip the blocks outside it "
                       '([how](architecture.md#sliding-window-attention)). It may change on resume (the '
                       'parameters are the same); the start-up `attention:` line names it')
MODEL.layer_pattern = key("", doc=(
                      'local and global layers: letters `L` (a local layer, within `model.sliding_window`) and '
                      '`G` (a global one, the whole causal prefix), repeated from the bottom layer up: `LLLLLG`'
                      ' is Gemma 3\'s, `LLLG` OLMo 3\'s, `LG` Gemma 2\'s. `""`: every layer alike. Needs at least '
                      'one `L`, `model.sliding_window` > 0 and layers enough to hold each of its kinds; in a '
                      "pipeline, each stage's chunk of layers must hold whole repeats. Scanned layers scan over"
                      ' groups of the pattern. It may change on resume (the parameters are the same) '
                      '([how](architecture.md#local-and-global-layers))'))
MODEL.rope_theta_local = key(0.0, NON_NEGATIVE,
                         "with a `layer_pattern` of both kinds: the local layers' RoPE base (Gemma 3: 10,000 "
                         'against the global 1,000,000); `0` = `model.rope_theta`. Local layers never take '
                         '`model.rope_scaling`')
MODEL.attn_logit_softcap = key(0.0, NON_NEGATIVE,
                           '> 0: each attention score (scaled q·k) becomes c·tanh(score / c) before the mask '
                           'and softmax (Gemma 2 uses 50); `0` = off. XLA and splash (its own '
                           '`attn_logits_soft_cap`) cap; cuDNN cannot, so `auto` picks XLA on GPUs with it and '
                           "`model.attention=cudnn` exits 2; the ring runs XLA's blocks for it. "
                           'Gemma2ForCausalLM holds it')
MODEL.attention_kind = key("gqa", one_of(ATTENTION_KINDS),
                       "`gqa` (grouped-query attention) or `mla` (DeepSeek-V2/V3's multi-head latent attention:"
                       ' keys and values from a latent that the generation cache holds; '
                       '[how](architecture.md#multi-head-latent-attention)). With `mla`, `model.num_kv_heads` '
                       'must equal `num_heads`, `model.head_dim` becomes `qk_nope_head_dim + qk_rope_head_dim` '
                       "(0 or that), positions are RoPE, no qk-norm or biases; the ring runs XLA's blocks for "
                       'it')
MODEL.q_lora_rank = key(1536, NON_NEGATIVE_INT,
                    "`mla`: the queries' bottleneck (0: a full query projection) and the keys' and values' "
                    "latent (DeepSeek-V3's)")
MODEL.kv_lora_rank = key(512, POSITIVE_INT, SAME)
MODEL.qk_nope_head_dim = key(128, POSITIVE_INT,
                         "`mla`: each head's query/key dims without and with RoPE (the RoPE ones an even "
                         'number, one key for all heads) and its value dims')
MODEL.qk_rope_head_dim = key(64, POSITIVE_INT, SAME)
MODEL.v_head_dim = key(128, POSITIVE_INT, SAME)
MODEL.qk_norm = key("none", one_of(QK_NORMS),
                "RMSNorm of the queries and keys before RoPE: `none`, `per_head` (each head's `head_dim`: "
                'Qwen3, Gemma 3) or `full` (the whole projection: OLMo 2) ([qk-norm](architecture.md#qk-norm))')
MODEL.dtype = key("float32", one_of(DTYPES),
              'compute dtype: `float32`, `bfloat16` or `float16` (float16 turns on [dynamic loss '
              'scaling](architecture.md#mixed-precision)). Parameters are float32, and so is the optimizer '
              'state unless `optim.mu_dtype` says otherwise')
MODEL.init_std = key(0.02, NON_NEGATIVE, 'see `model.rope_theta`')
MODEL.scan_layers = key(True, BOOL,
                    'one compiled layer body scanned over depth, so compile time stays flat as depth grows; '
                    "`False` unrolls the layers (same numbers; each layer's weight gradients are done before "
                    'the layer below starts its backward, [why](performance.md#compiled-for-v5p-no-tpu))')
MODEL.pipeline_microbatches = key(1, POSITIVE_INT,
                              'with `mesh.stage` > 1: microbatches per (accumulation) batch in the pipeline. '
                              '`batch_size` must be divisible by `grad_accum_steps × pipeline_microbatches × '
                              'mesh.data × mesh.fsdp`. The idle share (the bubble) is logged at start')
MODEL.pipeline_repeats = key(1, POSITIVE_INT,
                         "with `mesh.stage` = S > 1: R > 1 makes the pipeline circular (MaxText's "
                         '`num_pipeline_repeats`): each stage holds R non-adjacent chunks of layers (stage s: '
                         'chunks s, s + S, ...) and the microbatches go round the stages R times, so the bubble'
                         ' is (S − 1) / (R·M + S − 1) ([how](architecture.md#circular-pipelines)). '
                         "`model.num_layers` (and an MoE model's `model.first_dense_layers`) must be divisible "
                         'by S × R, `model.pipeline_microbatches` must be ≥ S, and R > 1 needs `mesh.stage` > '
                         '1. Checkpoints do not depend on it: a run may resume with another R')
MODEL.remat = key("none", one_of(REMAT),
              'activation rematerialisation: `none`, `full`, `save_dots` (keep weight-matmul outputs), '
              '`save_qkv_proj`, `save_out_proj`')
MODEL.attention = key("auto", one_of(ATTENTION),
                  "`xla` (einsum, float32 softmax), `cudnn` (cuDNN's fused flash attention through "
                  '`jax.nn.dot_product_attention`, causal mode; NVIDIA, 16-bit), `splash` (the Pallas '
                  'splash-attention kernel; TPU only, `seq_len` a multiple of 128). `auto` picks `splash` on '
                  'TPUs, `cudnn` on GPUs with 16-bit compute, otherwise `xla`; naming a kernel of another '
                  'platform exits 2; the log names the one used '
                  '([kernels](architecture.md#attention-kernels-and-fp8))')
MODEL.context_parallel = key("all_gather", one_of(CONTEXT_PARALLEL),
                         'how attention crosses `mesh.sequence` ([long-context.md](long-context.md)): '
                         '`all_gather` (keys and values gathered whole on every device), `ring` (key/value '
                         'blocks passed around the sequence axis, O(L/n) per device; splash per block on TPUs, '
                         'cuDNN on GPUs with 16-bit compute, XLA einsums elsewhere); `ulysses` (an all-to-all '
                         'trades the length split for a heads split around attention; any `model.attention` '
                         'kernel; `num_heads` divisible by `mesh.sequence` x `mesh.tensor`). With '
                         '`mesh.sequence=1` all are the same plain attention')
MODEL.context_load_balance = key(False, BOOL,
                             'with `ring`: zig-zag token order, each device holding an early and a late chunk, '
                             'so the causal work is even; `seq_len` divisible by 2 × `mesh.sequence`; not with '
                             '`model.mtp_depth`')
MODEL.splash_block_q = key(0, NON_NEGATIVE_INT,
                       "splash attention's query and key/value tiles, in tokens, for the forward pass and both "
                       'backward kernels: multiples of 128 that divide `seq_len` (`0`: the largest of 512, 256,'
                       ' 128 that divides it). `bench plan --target=` a TPU slice shows their effect on memory '
                       'and the estimate')
MODEL.splash_block_kv = key(0, NON_NEGATIVE_INT, SAME)
MODEL.fp8 = key(False, BOOL,
            "the layers' weight matmuls (q, k, v, o and the three SwiGLU ones; not the embedding, the LM head "
            'or attention) with float8 operands ([how](architecture.md#attention-kernels-and-fp8)). Native '
            'float8 GEMMs on NVIDIA GPUs of compute capability ≥ 8.9 (H100, H200); elsewhere it is emulated '
            "(fp8's numbers, not faster; the log warns). MFU still divides by `model.dtype`'s peak")
MODEL.logits_chunk_size = key(0, NON_NEGATIVE_INT,
                          '> 0: the loss computes logits this many positions at a time (rematerialised), so the'
                          ' float32 `[batch, seq, vocab]` logits never exist at once')
MODEL.final_logit_softcap = key(0.0, NON_NEGATIVE,
                            '> 0: the logits become c·tanh(logits / c), bounded by ±c (Gemma 2 uses 30), in '
                            'training, eval and generation alike; `0` = off. Gemma2ForCausalLM and '
                            'Gemma3ForCausalLM hold it')
MODEL.z_loss = key(0.0, NON_NEGATIVE,
               'extra loss terms (off by default); `loss` in the metrics stays the plain cross-entropy')
MODEL.label_smoothing = key(0.0, between("[0, 1)"), SAME)
MODEL.num_experts = key(0, NON_NEGATIVE_INT,
                    'a mixture of experts in every layer after `model.first_dense_layers` (0: a dense model); '
                    '[moe.md](moe.md)')
MODEL.experts_per_token = key(2, POSITIVE_INT,
                          "top-k; each expert's hidden size (0: `mlp_dim`); always-on experts; dense layers at "
                          'the bottom. `experts_per_token <= num_experts`, at least one MoE layer')
MODEL.expert_mlp_dim = key(0, NON_NEGATIVE_INT, SAME)
MODEL.shared_experts = key(0, NON_NEGATIVE_INT, SAME)
MODEL.first_dense_layers = key(0, NON_NEGATIVE_INT, SAME)
MODEL.router = key("softmax", one_of(ROUTERS),
               '`softmax` (Mixtral, Qwen3) or `sigmoid` (DeepSeek-V3, gates normalised); the gates times '
               '`router_scale`')
MODEL.router_renormalize = key(True, BOOL, SAME)
MODEL.router_scale = key(1.0, POSITIVE, SAME)
MODEL.router_groups = key(0, NON_NEGATIVE_INT,
                      'group-limited routing (DeepSeek-V3): experts in groups, only the best groups eligible; '
                      'groups divide the experts')
MODEL.router_topk_groups = key(0, NON_NEGATIVE_INT, SAME)
MODEL.load_balance = key("aux_loss", one_of(LOAD_BALANCE),
                     "the Switch/GShard balancing loss (or `bias`, `none`) and the router's z-loss, added to "
                     'the objective averaged over the MoE layers')
MODEL.load_balance_weight = key(0.01, NON_NEGATIVE, SAME)
MODEL.bias_update_rate = key(1e-3, POSITIVE,
                         "`load_balance=bias` (DeepSeek-V3's auxiliary-loss-free balancing): how far each step "
                         "moves every expert's selection bias towards the mean load (DeepSeek-V3's γ; "
                         '[moe.md](moe.md#auxiliary-loss-free-balancing))')
MODEL.router_z_loss = key(0.0, NON_NEGATIVE, 'see `model.load_balance`')
MODEL.capacity_factor = key(0.0, NON_NEGATIVE,
                        '0: dropless (grouped matmuls); > 0: each expert takes at most this × its fair share of'
                        " each sequence's tokens, the rest dropped ([per sequence](moe.md#compute))")
MODEL.grouped_matmul = key("auto", one_of(GROUPED_MATMUL),
                       "the dropless experts' grouped matmuls: `ragged_dot` (XLA's, any backend), `tiled` "
                       "(maxlm's loop of dense 128- or 256-row tile matmuls, any backend) or `megablox` (the "
                       'Pallas TPU kernel; refused elsewhere); `auto`: megablox on TPUs with float32/bfloat16 '
                       'compute (else ragged_dot there), tiled on CPUs and GPUs; [moe.md](moe.md#compute)')
MODEL.expert_dispatch = key("auto", one_of(EXPERT_DISPATCH),
                        "how the dropless layer's tokens reach experts split over `mesh.expert`: "
                        "`ragged_all_to_all` (each slot only to its expert's device, "
                        '`jax.lax.ragged_all_to_all`; emulated with all-gathers on CPUs, which cannot run it) '
                        "or `all_gather` (the expert group's tokens gathered, the outputs reduce-scattered "
                        'back); `auto`: ragged_all_to_all on GPUs and TPUs, all_gather on CPUs; '
                        '[moe.md](moe.md#parallelism)')
MODEL.mtp_depth = key(0, NON_NEGATIVE_INT,
                  'multi-token prediction (DeepSeek-V3): this many modules after the trunk, module k predicting'
                  ' the token k + 1 ahead, their mean cross-entropy times `mtp_loss_weight` added to the '
                  'objective (0: off). Dense and MoE models, pipelined too; less than `seq_len`; not with '
                  '`checkpoint.init_from_hf` ([multi-token prediction](architecture.md#multi-token-prediction))')
MODEL.mtp_loss_weight = key(0.3, NON_NEGATIVE, SAME)
