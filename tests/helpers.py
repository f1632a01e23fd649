"""Shared test helpers: loading configs/*.py, building synthetic packed batches and random
parameters, and reading back what a run left in its workdir (metrics.jsonl rows, checkpointed
states)."""

import dataclasses
import functools
import json
import math
import os
import pathlib
import socket

import jax
import jax.numpy as jnp
import numpy as np
from etils import epath
from xla_flags import with_test_flags, without_test_flags

from maxlm import config as config_lib, model
from maxlm.checkpoint import compatibility, store as checkpoint
from maxlm.observe import flops
from maxlm.optim import optimizers as optim
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from maxlm.train import step as step_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]


def load_config(name: str):
    return config_lib.load_file(str(ROOT / "configs" / f"{name}.py"))


# The CPU peak (FLOP/s) the commands tests start divide by for MFU, instead of probing it at every
# start (docs/testing.md): about the probe's reading on the 2-core host at the tests' XLA level 0
# (72-81 GFLOP/s, 2026-12-05). test_metrics.py tests the probe itself.
TEST_PEAK_FLOPS_PER_SEC = "8e10"


def command_env(home, devices: int | None = 8, target_compile: bool = False, **extra) -> dict:
    """The environment of a maxlm command a test starts: PATH, the CPU platform, `devices` fake CPU
    devices (None: one), `home` as HOME; no compilation cache (tests/conftest.py says why); the
    tests' fast CPU compiles (tests/xla_flags.py), unless the command compiles for a GPU or TPU
    `target_compile`; a given CPU peak in place of the start-up probe (`TEST_PEAK_FLOPS_PER_SEC`)."""
    env = {"PATH": "/usr/bin:/bin", "JAX_PLATFORMS": "cpu", "HOME": str(home),
           flops.PEAK_ENV: TEST_PEAK_FLOPS_PER_SEC}
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}" if devices else ""
    env.update(extra)
    env["XLA_FLAGS"] = (without_test_flags if target_compile else with_test_flags)(env["XLA_FLAGS"])
    return env


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a test's jax.distributed coordinator."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def with_overrides(cfg, overrides: dict):
    """Sets dotted keys ("optim.lr") on `cfg`, as `--config.optim.lr=...` would."""
    return config_lib.apply_overrides(cfg, overrides)


def tiny(*overrides: dict, mesh: tuple[int, int, int] | None = None, devices: int | None = None, **keys):
    """configs/tiny.py, resolved: the tests' one small config.

    `overrides` (dicts) and then the keyword args `keys` are set in the order given, each a dotted
    key (`steps=3`, `**{"optim.lr": 1e-3}`), or a section's name with a dict of its keys
    (`model=dict(d_model=32)`, as `cfg.model.update(...)`). `mesh`: (data, fsdp, tensor), the
    other axes as the config has them (set them as dotted keys, `**{"mesh.sequence": 4}`).
    `devices`: resolved for that many; by default, with `mesh`, for as many as the mesh's axes
    hold (all of JAX's where one is -1), else for all of JAX's."""
    cfg = load_config("tiny")
    for group in (*overrides, keys):
        for key, value in group.items():
            if isinstance(value, dict) and isinstance(cfg.get(key), config_lib.ml_collections.ConfigDict):
                cfg[key].update(value)
            else:
                with_overrides(cfg, {key: value})
    if mesh is not None:
        cfg.mesh.update(data=mesh[0], fsdp=mesh[1], tensor=mesh[2])
    if devices is None:
        size = math.prod(cfg.mesh[axis] for axis in config_lib.MESH_AXES)
        devices = size if mesh is not None and size > 0 else jax.device_count()
    return config_lib.resolve(cfg, devices)


def train_metrics(cfg, steps: int, batch_for_step, devices=None):
    """The metrics ({name: number}) of `steps` jitted train steps on `batch_for_step(step)`, on
    `devices` (default: all; `cfg` resolved for as many), and the final state."""
    rules = mesh_lib.rules_of(cfg.mesh)
    mesh = mesh_lib.make_mesh(cfg.mesh, devices)
    tx = optim.make_optimizer(cfg)
    state, shardings = state_lib.create_sharded_state(cfg, tx, mesh, rules, jax.random.key(cfg.seed))
    train_fn = step_lib.make_train_step(cfg, tx, mesh, rules, shardings)
    rows = []
    with mesh_lib.activate(mesh, rules):
        for step in range(steps):
            state, step_metrics = train_fn(state, mesh_lib.global_batch(batch_for_step(step), mesh, rules),
                                           np.float32(1.0))
            rows.append(jax.device_get(step_metrics))
    return rows, state


def train_losses(cfg, steps: int, batch_for_step, devices=None):
    """Losses of `steps` jitted train steps on `batch_for_step(step)`, and the final state."""
    rows, state = train_metrics(cfg, steps, batch_for_step, devices)
    return np.array([float(row["loss"]) for row in rows]), state


def synthetic_batch(cfg):
    """`batch_for_step` of the fixed synthetic packed batches `packed_batch(..., seed=step)`."""
    return lambda step: packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, seed=step)


def synthetic_losses(cfg, steps: int):
    """`train_losses` on the fixed synthetic packed batches `synthetic_batch`."""
    return train_losses(cfg, steps, synthetic_batch(cfg))


def packed_batch(batch_size: int, seq_len: int, vocab_size: int, seed: int = 0, docs_per_row: int = 3):
    """Random tokens packed as `docs_per_row` documents per row (positions restart per document)."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(3, vocab_size, size=(batch_size, seq_len + 1), dtype=np.int32)
    bounds = np.sort(rng.choice(np.arange(1, seq_len), size=(batch_size, docs_per_row - 1)), axis=1)
    segment_ids = np.ones((batch_size, seq_len), np.int32)
    positions = np.zeros((batch_size, seq_len), np.int32)
    for b in range(batch_size):
        starts = [0, *bounds[b].tolist()]
        for i, start in enumerate(starts):
            segment_ids[b, start:] = i + 1
        for start, end in zip(starts, [*starts[1:], seq_len]):
            positions[b, start:end] = np.arange(end - start)
    return {
        "inputs": tokens[:, :-1],
        "targets": tokens[:, 1:],
        "segment_ids": segment_ids,
        "positions": positions,
    }



def padded_packed_batch(batch_size, seq_len, vocab_size, seed):
    """`packed_batch` with several documents per row, and padding (segment 0) at some rows' ends."""
    batch = packed_batch(batch_size, seq_len, vocab_size, seed=seed, docs_per_row=4)
    batch["segment_ids"][::2, -seq_len // 5:] = 0
    return batch


def random_qkv(B=2, L=32, H=4, K=2, Dh=8, seed=0):
    """Random float32 q [B, L, H, Dh], k and v [B, L, K, Dh]."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.normal(size=shape), jnp.float32) for shape in ((B, L, H, Dh), (B, L, K, Dh), (B, L, K, Dh)))


def weighted_sum_of_squares(attend):
    """A scalar of `attend(q, k, v)`'s output that weights every output element differently."""
    def weighted(q, k, v):
        out = attend(q, k, v)
        return (out ** 2 * jnp.arange(1, out.shape[-1] + 1)).sum()
    return weighted


def padded_losses(cfg, steps: int, devices=None):
    """`train_losses` on `padded_packed_batch(..., seed=step)`."""
    batch_for_step = lambda step: padded_packed_batch(cfg.batch_size, cfg.seq_len, cfg.model.vocab_size, step)  # noqa: E731
    return train_losses(cfg, steps, batch_for_step, devices)[0]


@functools.lru_cache(maxsize=2)
def one_device_padded_losses(steps: int):
    """`padded_losses` of configs/tiny.py on one device: what the context-parallel runs must equal."""
    cfg = load_config("tiny")
    cfg.mesh.update(data=1, fsdp=1)
    return padded_losses(config_lib.resolve(cfg, 1), steps, jax.devices()[:1])


def assert_sharded_apply_equals_unsharded(cfg, batch=None, sharded_model_cfg=None, atol: float = 1e-5):
    """`model.apply`'s logits on `batch` (default: `padded_packed_batch(2, cfg.seq_len, ..., seed=0)`)
    under `cfg`'s mesh and rules are its logits on one device with no mesh, within `atol`; the
    same initial parameters for both. `sharded_model_cfg`: the model config the sharded side runs
    (default `cfg.model`; e.g. a kernel only a test can name). Returns the sharded side's
    lowering, for a test's checks of what it runs."""
    if batch is None:
        batch = padded_packed_batch(2, cfg.seq_len, cfg.model.vocab_size, 0)
    batch = {k: jnp.asarray(v) for k, v in batch.items()}
    params = model.init_params(cfg.model, jax.random.key(0))
    apply = lambda model_cfg: jax.jit(lambda p, b: model.apply(model_cfg, p, b))  # noqa: E731
    expected = apply(cfg.model)(params, batch)
    mesh, rules = mesh_lib.make_mesh(cfg.mesh), mesh_lib.rules_of(cfg.mesh)
    with mesh_lib.activate(mesh, rules):
        sharded_batch = mesh_lib.global_batch(batch, mesh, rules)
        lowered = apply(cfg.model if sharded_model_cfg is None else sharded_model_cfg).lower(params, sharded_batch)
        logits = lowered.compile()(params, sharded_batch)
    np.testing.assert_allclose(logits, expected, atol=atol)
    return lowered


def random_params(model_cfg, seed: int = 0, std: float = 0.05):
    """Random float32 parameters in init_params's layout (numpy draws: no init to compile): normal
    with `std`, the RMSNorm scales 1 + 0.2·normal (at their init, 1, a swapped norm would go
    unnoticed)."""
    shapes = jax.eval_shape(functools.partial(model.init_params, model_cfg), jax.random.key(0))
    rng = np.random.default_rng(seed)

    def draw(path, leaf):
        if "scale" in jax.tree_util.keystr(path):
            return jnp.asarray(1 + 0.2 * rng.standard_normal(leaf.shape), jnp.float32)
        return jnp.asarray(std * rng.standard_normal(leaf.shape), jnp.float32)

    return jax.tree_util.tree_map_with_path(draw, shapes)


# ----------------------------------------------------------------------------- a run's workdir


def metrics_rows(workdir, partial: bool = False) -> list[dict]:
    """The rows of `workdir`/metrics.jsonl in the order written (a resumed run repeats steps).

    `partial`: the file of a run under way or killed: no file yet reads as no rows, and a line
    that does not parse (cut short by a kill, or being written) is skipped. Otherwise both fail.
    """
    path = epath.Path(workdir) / "metrics.jsonl"  # a local path or a gs:// URL
    if partial and not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:
            if not partial:
                raise
    return rows


def train_rows(workdir, partial: bool = False) -> dict[int, dict]:
    """step -> the last training row (one with a loss) written for it."""
    return {row["step"]: row for row in metrics_rows(workdir, partial) if "loss" in row}


def losses(workdir, partial: bool = False) -> dict[int, float]:
    """step -> the loss of `train_rows`."""
    return {step: row["loss"] for step, row in train_rows(workdir, partial).items()}


def _checkpoint_path(workdir, step: int) -> str:
    return os.path.join(os.fspath(workdir), "checkpoints", str(step))  # a local path or a gs:// URL


def saved_state(workdir, step: int) -> dict:
    """The state checkpointed at `step` in `workdir` (restored with the config recorded in the
    checkpoint, onto one device), as numpy arrays."""
    path = _checkpoint_path(workdir, step)
    state, _ = checkpoint.restore_state(path, compatibility.expected_state(checkpoint.read_json(path, "config")))
    return jax.tree.map(np.asarray, jax.device_get(state))


def saved_meta(workdir, step: int) -> dict:
    """The meta (step, data position, ...) saved with the checkpoint of `step` in `workdir`."""
    return checkpoint.read_json(_checkpoint_path(workdir, step), "meta")


# ----------------------------------------------------------------------------- devices


@dataclasses.dataclass(frozen=True)
class FakeDevice:
    """What mesh building reads of a device: enough to lay out processes without starting them."""

    id: int
    process_index: int
    platform: str = "cpu"
    device_kind: str = "cpu"
    slice_index: int = 0  # multi-process CPU/GPU devices report slice 0 everywhere


def fake_devices(processes: int, per_process: int, **extra) -> list[FakeDevice]:
    """`processes` x `per_process` FakeDevices, ids in process order (`extra`: their other fields)."""
    return [FakeDevice(p * per_process + i, p, **extra) for p in range(processes) for i in range(per_process)]


def ring_blocks_one_after_another(kernel, q_BLHDh, k_BSKDh, v_BSKDh, segment_ids_BL, n: int, dout_BLHDh):
    """The ring's fused-kernel computations (maxlm/model/parallel/ring_blocks.py) for n devices run one
    after another on one device, no mesh: (out, dq, dk, dv) as the ring gives them, for checking
    a kernel where there is a single accelerator. Each device's queries merge its own block, then
    the others in ring order; the backward pass feeds every block the whole rows' output and
    log-sum-exp."""
    from maxlm.model.parallel import ring_blocks, zigzag

    L, Dh = q_BLHDh.shape[1], q_BLHDh.shape[-1]
    order = zigzag.token_order(L, n) if kernel.zigzag else np.arange(L)
    heads_major = lambda x: jnp.swapaxes(x[:, order], 1, 2)  # noqa: E731  [B, H, L, Dh] in ring order
    q = heads_major(q_BLHDh * jnp.asarray(1 / np.sqrt(Dh), q_BLHDh.dtype))
    k, v, dout = heads_major(k_BSKDh), heads_major(v_BSKDh), heads_major(dout_BLHDh).astype(q.dtype)
    segment_ids = segment_ids_BL[:, order]
    index = jnp.asarray(order)
    block = L // n
    part = lambda x, i: x[..., i * block:(i + 1) * block, :] if x.ndim == 4 else x[..., i * block:(i + 1) * block]  # noqa: E731
    outs, lses = [], []
    for i in range(n):
        acc = (jnp.zeros(part(q, i).shape, jnp.float32), jnp.full(part(q, i).shape[:-1], -jnp.inf, jnp.float32))
        for j in [(i - hop) % n for hop in range(n)]:
            acc = ring_blocks.merge(acc, *ring_blocks.forward(
                kernel, ring_blocks.relation(part(index, i), part(index, j)), part(q, i), part(k, j), part(v, j),
                part(segment_ids, i), part(segment_ids, j)))
        outs.append(acc[0].astype(q.dtype))
        lses.append(acc[1])
    dq, dk, dv = [0.0] * n, [0.0] * n, [0.0] * n
    for i in range(n):
        for j in range(n):
            grads = ring_blocks.backward(kernel, ring_blocks.relation(part(index, i), part(index, j)), part(q, i),
                                         part(k, j), part(v, j), part(segment_ids, i), part(segment_ids, j), outs[i],
                                         lses[i], part(dout, i))
            dq[i], dk[j], dv[j] = dq[i] + grads[0], dk[j] + grads[1], dv[j] + grads[2]
    back = np.argsort(order)
    original = lambda parts: jnp.swapaxes(jnp.concatenate(parts, axis=2), 1, 2)[:, back]  # noqa: E731
    return original(outs), original(dq) / np.sqrt(Dh), original(dk), original(dv)
