"""Ulysses context parallelism (`model.context_parallel="ulysses"`): the same numbers as plain
attention, keys and values exchanged by all-to-all (never gathered whole), the config's rules."""

import functools
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.model import attention
from maxlm.model.parallel import ulysses
from maxlm.sharding import mesh as mesh_lib
from tests.helpers import (
    ROOT,
    assert_sharded_apply_equals_unsharded,
    command_env,
    load_config,
    one_device_padded_losses,
    padded_losses,
    padded_packed_batch,
    random_qkv,
    weighted_sum_of_squares,
)


def ulysses_config(data=2, fsdp=1, sequence=4, tensor=1, heads=4, kv_heads=2, **overrides):
    cfg = load_config("tiny")
    cfg.mesh.update(data=data, fsdp=fsdp, sequence=sequence, tensor=tensor)
    cfg.model.update(num_heads=heads, num_kv_heads=kv_heads)
    config_lib.apply_overrides(cfg, {"model.context_parallel": "ulysses", **overrides})
    return config_lib.resolve(cfg, data * fsdp * sequence * tensor)


@pytest.mark.parametrize("mesh, kv_heads", [
    ({"data": 2, "sequence": 4}, 2),  # 2 kv heads over 4 devices: each repeated twice
    ({"data": 2, "sequence": 2, "tensor": 2}, 4),  # heads over sequence x tensor, 1 kv head each: no repeats
], ids=["kv_heads_repeated", "with_tensor"])
def test_ulysses_output_and_gradients_equal_xla_attention(mesh, kv_heads):
    """Several documents per row and padding: Ulysses' output and gradients are xla_attention's
    with the full mask, whether kv heads are repeated to split or not, and with a tensor axis."""
    cfg = ulysses_config(kv_heads=kv_heads, **{f"mesh.{k}": v for k, v in mesh.items()})
    q, k, v = random_qkv(K=kv_heads)
    segment_ids = jnp.asarray(padded_packed_batch(2, q.shape[1], 10, seed=1)["segment_ids"])
    expected = weighted_sum_of_squares(lambda q, k, v: attention.xla_attention(q, k, v, attention.attention_mask(segment_ids)))
    split = weighted_sum_of_squares(lambda q, k, v: ulysses.attend("xla", q, k, v, segment_ids))
    value, grads = jax.value_and_grad(expected, argnums=(0, 1, 2))(q, k, v)
    with mesh_lib.activate(mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)):
        assert ulysses.applies(cfg.model, *q.shape[:2])
        split_value, split_grads = jax.jit(jax.value_and_grad(split, argnums=(0, 1, 2)))(q, k, v)
    np.testing.assert_allclose(split_value, value, rtol=1e-5)
    for name, a, b in zip("qkv", grads, split_grads):
        np.testing.assert_allclose(b, a, atol=1e-5, rtol=1e-5, err_msg=f"d{name}")


def test_ulysses_with_the_splash_kernel_equals_xla_attention():
    """Each device runs the configured kernel on whole rows: splash (the Pallas interpreter here)."""
    cfg = ulysses_config()
    q, k, v = random_qkv(L=128, Dh=16)
    segment_ids = jnp.asarray(padded_packed_batch(2, 128, 10, seed=2)["segment_ids"])
    expected = attention.xla_attention(q, k, v, attention.attention_mask(segment_ids))
    with mesh_lib.activate(mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)):
        out = jax.jit(lambda q, k, v: ulysses.attend(attention.SPLASH_INTERPRET, q, k, v, segment_ids))(q, k, v)
    np.testing.assert_allclose(out, expected, atol=1e-5, rtol=1e-5)


def test_ulysses_exchanges_by_all_to_all_and_never_gathers_keys():
    """The compiled attention moves q, k, v and the output with all-to-alls; the only all-gather is
    of the [B, L] segment ids (int32), never of a [B, L, K, Dh] array."""
    cfg = ulysses_config()
    q, k, v = random_qkv(L=64)
    segment_ids = jnp.ones(q.shape[:2], jnp.int32)
    with mesh_lib.activate(mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)):
        hlo = jax.jit(functools.partial(ulysses.attend, "xla")).lower(q, k, v, segment_ids).compile().as_text()
    assert hlo.count("all-to-all(") >= 4, hlo  # q, k, v there, the output back
    gathers = [line for line in hlo.splitlines() if " all-gather(" in line or "all-gather-start(" in line]
    assert gathers and all(line.split("=")[1].strip().startswith("s32[") for line in gathers), gathers


def test_kv_repeats_make_the_kv_heads_split_evenly():
    assert [ulysses.kv_repeats(k, 4) for k in (1, 2, 4, 8)] == [4, 2, 1, 1]
    assert ulysses.kv_repeats(2, 8) == 4 and ulysses.kv_repeats(6, 4) == 2


@pytest.mark.parametrize("window", [0, 9], ids=["causal", "sliding_window"])
def test_the_model_under_ulysses_gives_the_unsharded_logits(window):
    """`apply` with sequence=4 x data=2 (grouped-query heads repeated) runs Ulysses in every layer
    and gives the unsharded logits on packed rows with padding, causal or with a sliding window
    (each device masks whole rows). Training: the ci test below."""
    lowered = assert_sharded_apply_equals_unsharded(ulysses_config(**{"model.sliding_window": window}))
    assert "all_to_all" in lowered.as_text()


@pytest.mark.ci
def test_ulysses_training_equals_one_device_over_20_steps_and_is_bitwise_deterministic():
    """20 train steps with sequence=4 x fsdp=2 equal the 1-device run (packed rows, padding), and a
    rerun's first steps are bitwise the same."""
    cfg = ulysses_config(data=1, fsdp=2)
    losses = padded_losses(cfg, 20)
    np.testing.assert_allclose(losses, one_device_padded_losses(20), rtol=1e-4)
    np.testing.assert_array_equal(padded_losses(cfg, 2), losses[:2])


def test_ulysses_config_rules():
    with pytest.raises(config_lib.ConfigError, match=r"model.num_heads=4 must be divisible by mesh.sequence x "
                                                     r"mesh.tensor = 4 x 2 = 8 with model.context_parallel='ulysses'"):
        ulysses_config(data=1, sequence=4, tensor=2, heads=4, kv_heads=2)
    with pytest.raises(config_lib.ConfigError, match="model.context_load_balance=True needs model.context_parallel='ring'"):
        ulysses_config(**{"model.context_load_balance": True})
    cfg = load_config("tiny")
    cfg.mesh.update(stage=2, data=1, fsdp=1, sequence=4)
    cfg.model.pipeline_microbatches = 2
    # in a pipeline too, with the backend's kernel (tests/test_kernels.py runs splash there)
    piped = config_lib.resolve(config_lib.apply_overrides(cfg, {"model.context_parallel": "ulysses",
                                                                "model.attention": "splash", "seq_len": 128}), 8)
    assert piped.model.attention == "splash"
    assert ulysses_config(sequence=1, data=8).model.context_parallel == "ulysses"  # a no-op, allowed
    # the kernels need whole rows, which Ulysses gives them: not refused under mesh.sequence
    assert ulysses_config(**{"model.attention": "xla"}).model.attention == "xla"


def test_the_cli_refuses_heads_that_do_not_split_before_compiling(tmp_path, data_dirs):
    command = [sys.executable, "-m", "maxlm.train", "--config=configs/tiny.py", f"--workdir={tmp_path / 'run'}",
               *(f"--config.{k}={v}" for k, v in data_dirs.items()),
               "--config.model.context_parallel=ulysses", "--config.mesh.sequence=8", "--config.mesh.fsdp=1"]
    result = subprocess.run(command, cwd=ROOT, env=command_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-3000:]
    assert result.stderr.strip().splitlines()[-1] == (
        "maxlm: config error: model.num_heads=4 must be divisible by mesh.sequence x mesh.tensor = 8 x 1 = 8 with "
        "model.context_parallel='ulysses' (each device attends with num_heads / 8 heads over the whole sequence)")
    assert not (tmp_path / "run" / "checkpoints").exists()
