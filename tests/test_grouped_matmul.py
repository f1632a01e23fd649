"""The dropless MoE's grouped matmul (maxlm/model/moe/grouped_matmul.py): the megablox kernel, run by
the Pallas interpreter on CPU, and the tiled loop (maxlm/model/kernels/tiled_matmul.py) give ragged_dot's
outputs and gradients (alone, with rows padded to their tiles and empty groups, and as the MoE
layer's backend on an 8-device mesh, where each device multiplies its share of the sorted rows);
"auto" picks megablox on TPUs and tiled on CPUs, and megablox off a TPU is a one-line config error. The TPU compile itself: tests/test_tpu_plan.py."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib
from maxlm.model.moe import grouped_matmul as gm
from maxlm.runtime.errors import ConfigError
from tests.test_moe import assert_close, assert_the_layer_on_a_mesh_equals

INTERPRET = gm.MEGABLOX_INTERPRET


def test_megablox_equals_ragged_dot_outputs_and_gradients():
    N, F = 200, 96  # 200 rows: padded to the 256-row tile
    keys = jax.random.split(jax.random.key(0), 3)
    x_ND = jax.random.normal(keys[0], (N, 64))
    w_EDF = jax.random.normal(keys[1], (4, 64, F))
    sizes_E = jnp.array([50, 0, 120, 30], jnp.int32)  # an empty group, groups across tile edges
    probe_NF = jax.random.normal(keys[2], (N, F))

    def loss(backend, x_ND, w_EDF):
        return jnp.sum(gm.grouped_matmul(x_ND, w_EDF, sizes_E, backend) * probe_NF)

    assert_close(gm.grouped_matmul(x_ND, w_EDF, sizes_E, INTERPRET), jax.lax.ragged_dot(x_ND, w_EDF, sizes_E), 1e-5)
    got = jax.grad(loss, (1, 2))(INTERPRET, x_ND, w_EDF)
    want = jax.grad(loss, (1, 2))("ragged_dot", x_ND, w_EDF)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, 1e-5)
    assert np.abs(got[1][1]).max() == 0  # the empty group's weights get no gradient


@pytest.mark.parametrize("sizes", [[50, 0, 120, 30], [0, 0, 0, 200], [64, 64, 8, 64], [1, 1, 1, 197]])
@pytest.mark.parametrize("tile,tiles_per_step", [(8, 1), (64, 1), (256, 1), (8, 3), (64, 4)])
def test_tiled_equals_ragged_dot_outputs_and_gradients(sizes, tile, tiles_per_step):
    """Groups spanning many tiles (tile 8), filling whole tiles, empty, and smaller than one tile;
    one tile per loop step, and several (a step's tiles from different groups, unused ones)."""
    N, F = 200, 48
    keys = jax.random.split(jax.random.key(0), 3)
    x_ND = jax.random.normal(keys[0], (N, 32))
    w_EDF = jax.random.normal(keys[1], (4, 32, F))
    sizes_E = jnp.array(sizes, jnp.int32)
    probe_NF = jax.random.normal(keys[2], (N, F))

    def loss(backend, x_ND, w_EDF):
        return jnp.sum(gm.grouped_matmul(x_ND, w_EDF, sizes_E, backend) * probe_NF)

    tiled = lambda x, w: gm.tiled_matmul(x, w, sizes_E, tile, tiles_per_step)  # noqa: E731
    assert_close(jax.jit(tiled)(x_ND, w_EDF), jax.lax.ragged_dot(x_ND, w_EDF, sizes_E), 1e-6)
    got = jax.jit(jax.grad(lambda x, w: jnp.sum(tiled(x, w) * probe_NF), (0, 1)))(x_ND, w_EDF)
    want = jax.grad(loss, (1, 2))("ragged_dot", x_ND, w_EDF)
    for g, w in zip(got, want, strict=True):
        assert_close(g, w, 1e-5)


def test_tiled_runs_in_bfloat16_and_under_vmap():
    """bfloat16 rows (float32 accumulation), and a batch of independent problems (as a pipeline's
    stages are vmapped) each with its own group sizes."""
    keys = jax.random.split(jax.random.key(1), 2)
    x_SND = jax.random.normal(keys[0], (2, 40, 16))
    w_SEDF = jax.random.normal(keys[1], (2, 3, 16, 24))
    sizes_SE = jnp.array([[10, 30, 0], [0, 5, 35]], jnp.int32)
    for tiles_per_step in (1, 2):
        got = jax.vmap(lambda x, w, s, c=tiles_per_step: gm.tiled_matmul(x, w, s, 8, c))(x_SND, w_SEDF, sizes_SE)
        for s in range(2):
            assert_close(got[s], jax.lax.ragged_dot(x_SND[s], w_SEDF[s], sizes_SE[s]), 1e-6)
    half = gm.tiled_matmul(x_SND[0].astype(jnp.bfloat16), w_SEDF[0].astype(jnp.bfloat16), sizes_SE[0], 8)
    assert half.dtype == jnp.bfloat16
    assert_close(half.astype(jnp.float32), jax.lax.ragged_dot(x_SND[0], w_SEDF[0], sizes_SE[0]), 0.1)


def test_local_sizes_split_the_groups_at_the_shard_edges():
    sizes_E = jnp.array([5, 0, 7, 4], jnp.int32)
    np.testing.assert_array_equal(gm.local_sizes(sizes_E, 4, 16), [[4, 0, 0, 0], [1, 0, 3, 0], [0, 0, 4, 0],
                                                                   [0, 0, 0, 4]])


@pytest.mark.parametrize("backend,axes", [
    (INTERPRET, {"fsdp": 4, "data": 2}),  # each device sorts its own tokens, all experts' weights
    (INTERPRET, {"expert": 4, "data": 2}),  # expert parallelism: the kernel on each device's experts
    (INTERPRET, {"expert": 2, "tensor": 2, "data": 2}),  # ... on a slice of their hidden units, psum'd
    ("tiled", {"fsdp": 2, "tensor": 2, "data": 2}),
    ("tiled", {"expert": 4, "data": 2}),
], ids=["megablox-fsdp4_data2", "megablox-expert4_data2", "megablox-expert2_tensor2_data2",
        "tiled-fsdp2_tensor2_data2", "tiled-expert4_data2"])
def test_the_moe_layer_on_a_kernel_over_a_mesh_equals_ragged_dot(backend, axes):
    assert_the_layer_on_a_mesh_equals(axes, "grouped_matmul", backend, "ragged_dot")


def test_auto_is_megablox_on_tpus_and_tiled_on_cpus_and_gpus(monkeypatch):
    assert gm.grouped_matmul_backend("auto", jnp.bfloat16) == "tiled"  # CPU
    assert gm.grouped_matmul_backend("auto", jnp.float16, "cpu") == "tiled"
    assert gm.grouped_matmul_backend("auto", jnp.bfloat16, "gpu") == "tiled"
    assert gm.grouped_matmul_backend("auto", jnp.bfloat16, "tpu") == "megablox"
    assert gm.grouped_matmul_backend("auto", jnp.float16, "tpu") == "ragged_dot"  # not the kernel's dtype
    assert gm.grouped_matmul_backend("ragged_dot", jnp.bfloat16, "tpu") == "ragged_dot"
    with pytest.raises(ConfigError, match="model.grouped_matmul='megablox' needs a TPU, not cpu"):
        gm.grouped_matmul(jnp.zeros((8, 4)), jnp.zeros((2, 4, 4)), jnp.array([4, 4], jnp.int32), "megablox")
    monkeypatch.setattr(jax, "default_backend", lambda: "tpu")
    assert gm.grouped_matmul_backend("auto", jnp.float32) == "megablox"


def test_megablox_off_a_tpu_is_a_config_error():
    cfg = config_lib.defaults()
    cfg.model.num_experts, cfg.model.grouped_matmul = 8, "megablox"
    with pytest.raises(ConfigError, match="model.grouped_matmul='megablox' is a TPU kernel, and this runs on 'cpu'"):
        config_lib.resolve(cfg, 8, platform="cpu")
    assert config_lib.resolve(cfg, 8, platform="tpu").model.grouped_matmul == "megablox"


def test_bench_grouped_matmul_times_each_cpu_backend_through_the_cli():
    cmd = [sys.executable, "-m", "maxlm.bench", "grouped_matmul", "--config=configs/moe_tiny.py", "--steps=2",
           "--config.batch_size=8", "--config.seq_len=32"]
    result = json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)
    assert result["rows"] == 8 * 32 * 2 and result["experts"] == 8
    assert set(result["fwd_bwd_sec_median"]) == {"ragged_dot", "tiled", "dense"}
    assert set(result["over_dense_median"]) == {"ragged_dot", "tiled"}
    assert all(t > 0 for t in result["fwd_bwd_sec_median"].values())
    dense = subprocess.run(cmd[:4] + ["--config=configs/tiny.py"], capture_output=True, text=True)
    assert dense.returncode == 2 and "model.num_experts > 0" in dense.stderr


def test_the_tiling_keeps_padding_and_the_gathered_weights_bounded():
    """256-row tiles only when the groups average 512 rows; tiles per step a power of two, the
    weights one step gathers within STEP_WEIGHT_BYTES, never more tiles than there can be."""
    from maxlm.model.kernels import tiled_matmul as tm
    assert tm.default_tile(65536, 128) == 256 and tm.default_tile(65535, 128) == 128
    qwen3 = jax.ShapeDtypeStruct((128, 2048, 768), jnp.bfloat16)  # 3 MiB a tile: 42 fit
    assert tm.default_tiles_per_step(65536, qwen3, 256) == 32
    mixtral = jax.ShapeDtypeStruct((8, 4096, 14336), jnp.bfloat16)  # 112 MiB: one at a time
    assert tm.default_tiles_per_step(16384, mixtral, 256) == 1
    small = jax.ShapeDtypeStruct((4, 32, 48), jnp.float32)
    assert tm.default_tiles_per_step(200, small, 64) == 8  # ceil(200 / 64) + 4 experts = 8 tiles
    assert tm.default_tiles_per_step(10, small, 64) == 4  # 1 + 4 = 5 tiles: the power of two below
