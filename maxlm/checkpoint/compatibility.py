"""Whether a checkpoint fits a config: the checks made before a run starts from one (`start_problem`)
and those of `python -m maxlm.checkpoint verify` (`verify_one`). They read the checkpoint's recorded
config and its arrays' metadata; only `verify_one` restores the arrays.
"""

from __future__ import annotations

import os

import jax

from maxlm import config as config_lib
from maxlm.checkpoint.store import file_problem, finite_state, read_json, restore_state, shape_problem, short
from maxlm.observe import metrics
from maxlm.optim import optimizers as optim
from maxlm.sharding import state as state_lib


def expected_state(config_dict: dict):
    """The state's ShapeDtypeStructs (on one device) for a recorded config: what a checkpoint of
    it must hold, and the target to restore it into."""
    cfg = config_lib.from_recorded(config_dict)
    tx = optim.make_optimizer(cfg)
    return state_lib.abstract_state(cfg, tx, jax.sharding.SingleDeviceSharding(jax.devices()[0]))


# Every `model.*` key in one of three classes (tests/test_refused_runs.py asserts each is in
# exactly one, so a new key cannot be left out; docs/checkpoints.md#what-may-change-on-resume
# lists them for users). FUNCTION: what the parameters compute, or their shapes and layout
# (scan_layers stacks the layers' arrays: the shape check refuses that first); a resume or a
# start from a checkpoint with another value would load the parameters into another function,
# so it is refused (exit 2). ENCODING: the position encoding, which changes only together with
# seq_len on a full-state resume, to extend the context (docs/checkpoints.md#extending-the-context).
# FREE: how the same function is computed (kernels, remat, scan, compute dtype, the parallel
# schedule), the objective's extra terms, the initialisation (unused when restoring), and the
# attention window keys documented as changeable on resume (docs/config.md).
FUNCTION_KEYS = (
    "num_layers", "d_model", "num_heads", "num_kv_heads", "head_dim", "mlp_dim", "vocab_size", "tie_embeddings",
    "positions", "max_positions", "norm_eps", "norm_placement", "norm", "norm_plus_one", "scale_embeddings",
    "mlp_activation", "use_bias", "qkv_bias", "attn_logit_softcap", "final_logit_softcap", "attention_kind",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_norm",
    "num_experts", "experts_per_token", "expert_mlp_dim", "shared_experts", "first_dense_layers", "router",
    "router_renormalize", "router_scale", "router_groups", "router_topk_groups", "load_balance",
    "capacity_factor", "mtp_depth", "scan_layers")
ENCODING_KEYS = ("rope_theta", "rope_scaling", "rope_scaling_factor", "rope_original_max_len", "rope_low_freq_factor",
                 "rope_high_freq_factor", "rope_beta_fast", "rope_beta_slow", "rope_theta_local")
FREE_KEYS = (
    "sliding_window", "layer_pattern", "attention", "context_parallel", "context_load_balance", "splash_block_q",
    "splash_block_kv", "dtype", "fp8", "remat", "pipeline_microbatches", "pipeline_repeats",
    "logits_chunk_size", "grouped_matmul", "expert_dispatch", "init_std", "z_loss", "label_smoothing",
    "load_balance_weight", "router_z_loss", "mtp_loss_weight", "bias_update_rate",
    "from_hf")  # from_hf: where the keys came from, not what they compute (those are compared)

_MLA = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
_MOE = ("experts_per_token", "expert_mlp_dim", "shared_experts", "first_dense_layers", "router", "router_renormalize",
        "router_scale", "router_groups", "router_topk_groups", "load_balance", "capacity_factor")


def _used(key: str, m) -> bool:
    """Whether the model `m` reads `key` at all: a key of a part it lacks (MLA's with GQA, the
    router's in a dense model, a RoPE scaling's parameters without one) may differ harmlessly."""
    if key in _MLA:
        return m.attention_kind == "mla"
    if key in _MOE:
        return m.num_experts > 0
    if key.startswith("rope_") and key not in ("rope_theta", "rope_scaling", "rope_theta_local"):
        return m.rope_scaling != "none"
    if key == "rope_theta_local":
        return bool(m.layer_pattern)
    if key == "max_positions":
        return m.positions == "learned"
    return True


def model_changes(saved, now, keys) -> list[str]:
    """`model.KEY=NOW (checkpoint: SAVED)` for each of `keys` that differs between the model
    configs `saved` and `now` and that either of them uses."""
    return [f"model.{k}={now[k]!r} (checkpoint: {saved[k]!r})" for k in keys
            if saved[k] != now[k] and (_used(k, saved) or _used(k, now))]


def _function_problem(path: str, saved, cfg, full_state: bool) -> str | None:
    """Why the parameters at `path` would compute another function under `cfg`, or None."""
    if differ := model_changes(saved.model, cfg.model, FUNCTION_KEYS):
        return (f"the checkpoint {path} was trained as another model: {', '.join(differ)}; its parameters would "
                "compute another function. Resume with the checkpoint's settings, or start another workdir "
                "(what may change on resume: docs/checkpoints.md#what-may-change-on-resume)")
    encoding = model_changes(saved.model, cfg.model, ENCODING_KEYS)
    if full_state and encoding and saved.seq_len == cfg.seq_len:
        return (f"the checkpoint {path} was trained with another position encoding: {', '.join(encoding)}, at the "
                f"same seq_len={cfg.seq_len}: a resume changes the encoding only to extend the context, with a "
                "longer seq_len and data.resume_position=tokens or start (docs/checkpoints.md#extending-the-context); "
                "else resume with the checkpoint's settings")
    return None


def _positions(model_cfg) -> str:
    table = f", model.max_positions={model_cfg.max_positions}" if model_cfg.positions == "learned" else ""
    return f"model.positions={model_cfg.positions!r}{table}"


def config_changes(saved: dict, now: dict) -> list[str]:
    """`KEY=NOW (checkpoint: SAVED)` for each config key whose value differs, those that shape the
    state (`model.*`, `optim.*`) alone when there are any."""
    a, b = metrics.flatten_config(saved), metrics.flatten_config(now)  # tuples and lists alike, as JSON
    changed = [k for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
    shaping = [k for k in changed if k.startswith(("model.", "optim."))]
    return [f"{k}={b.get(k)!r} (checkpoint: {a.get(k)!r})" for k in (shaping or changed)]


def start_problem(path: str, cfg, full_state: bool) -> str | None:
    """Why `cfg` cannot start from the checkpoint at `path`, or None: its parameters were written
    with another position encoding or learned table length; for a `full_state`, its optimizer
    state by another `optim.name`; its model differs in a key of FUNCTION_KEYS, or (for a
    `full_state` at the same seq_len) of ENCODING_KEYS, named with both values; or its arrays have
    other shapes (another model size), named by the config keys that differ from the
    checkpoint's recorded config. Restoring regardless would fail or train another function, and
    such a checkpoint is not damaged."""
    saved = config_lib.from_recorded(read_json(path, "config"))
    if _positions(saved.model) != _positions(cfg.model):
        return (f"{_positions(cfg.model)}, but the checkpoint {path} was written with {_positions(saved.model)}: "
                "its parameters do not fit; resume with its settings or start another workdir")
    if full_state and saved.optim.name != cfg.optim.name:
        return (f"optim.name={cfg.optim.name!r}, but the checkpoint {path} holds {saved.optim.name!r} optimizer "
                f"state: resume with optim.name={saved.optim.name!r}, or start a new workdir from its "
                f"parameters (checkpoint.restore_from={path} checkpoint.restore_params_only=True)")
    if (misfit := shape_problem(path, expected_state(cfg.to_dict()), params_only=not full_state)) is not None:
        changes = config_changes(saved.to_dict(), cfg.to_dict())
        return (f"the checkpoint {path} does not fit this config ({misfit}); the config differs from the "
                f"checkpoint's in {', '.join(changes) or 'no key'}. Resume with the checkpoint's settings, or "
                "start another workdir (checkpoint.restore_from with checkpoint.restore_params_only=True keeps "
                "the parameters when only the optimizer changed)")
    return _function_problem(path, saved, cfg, full_state)  # the same shapes, another function


def verify_one(path: str, config_dict: dict | None = None) -> str | None:
    """None if the checkpoint at `path` is complete, restores, is finite and has the shapes of
    its config (or of `config_dict`); else what is wrong."""
    if (problem := file_problem(path)) is not None:
        return problem
    try:
        expected = expected_state(config_dict or read_json(path, "config"))
        if (misfit := shape_problem(path, expected)) is not None:
            return f"shapes differ from the config ({misfit})"
        state, meta = restore_state(path, expected)
    except Exception as e:  # noqa: BLE001
        return f"does not restore ({short(e)})"
    if not bool(finite_state(state)):
        return "holds non-finite values"
    if int(state["step"]) != int(os.path.basename(path)) or meta.get("step") != int(state["step"]):
        return f"step mismatch (state {int(state['step'])}, meta {meta.get('step')})"
    return None
