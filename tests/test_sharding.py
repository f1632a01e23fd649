"""Sharded training: the same numbers on every mesh, and state really sharded as the rules say."""

import functools

import jax
import ml_collections
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.optim import optimizers as optim
from maxlm.sharding import mesh as mesh_lib, state as state_lib
from tests.helpers import FakeDevice, fake_devices, load_config, synthetic_losses

MESHES = [(1, 8, 1), (2, 2, 2), (2, 1, 4)]  # against data=8: fsdp alone, all three, tensor 4 with data
STEPS = 10


def mesh_config(data, fsdp, tensor):
    cfg = load_config("tiny")
    cfg.mesh.update(data=data, fsdp=fsdp, tensor=tensor)
    cfg.model.update(num_heads=8, num_kv_heads=4, d_model=64)  # heads divisible by tensor=4
    return config_lib.resolve(cfg, jax.device_count())


def run(cfg, steps=STEPS):
    """Losses of `steps` train steps on fixed synthetic batches; also returns the final state."""
    return synthetic_losses(cfg, steps)


@pytest.fixture(scope="module")
def reference_losses():
    return run(mesh_config(1, 1, 1) if jax.device_count() == 1 else mesh_config(8, 1, 1))[0]


@pytest.mark.parametrize("shape", MESHES, ids=lambda s: "x".join(map(str, s)))
def test_same_losses_on_every_mesh(shape, reference_losses):
    losses, _ = run(mesh_config(*shape))
    assert losses[-1] < losses[0]  # it trains
    np.testing.assert_allclose(losses, reference_losses, rtol=1e-4)


@pytest.mark.ci  # make test keeps within its 12 minutes (CI runs it: make test-ci)
def test_both_layer_layouts_start_and_train_alike():
    """`model.scan_layers` changes the compiled program, not the run: from the same seed the
    unrolled layout starts from the scanned parameters (bitwise) and trains to the same losses."""
    scanned = mesh_config(2, 2, 2)
    unrolled = config_lib.apply_overrides(ml_collections.ConfigDict(scanned.to_dict()),
                                          {"model.scan_layers": False})
    key = jax.random.key(scanned.seed)
    stacked = model.stack_layers(model.init_params(unrolled.model, key))
    for a, b in zip(jax.tree.leaves(stacked), jax.tree.leaves(model.init_params(scanned.model, key))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    losses_scanned, _ = run(scanned, steps=8)
    losses_unrolled, _ = run(unrolled, steps=8)
    np.testing.assert_allclose(losses_unrolled, losses_scanned, rtol=0, atol=1e-5)


def test_state_is_sharded_as_the_rules_say():
    cfg = mesh_config(2, 2, 2)
    _, state = run(cfg, steps=1)
    specs = mesh_lib.describe(state)
    wq = "['layers']['attn']['wq']"
    # params: embed dim over fsdp and sequence (ZeRO-3; sequence is 1 here), heads over tensor
    # (Megatron); data replicates; the scanned `layers` axis is split over pipeline stages (`stage`,
    # size 1 here).
    embed = "('fsdp', 'sequence')"
    assert specs[f"['params']{wq}"] == f"P('stage', {embed}, 'tensor', None)"
    assert specs["['params']['layers']['mlp']['w_down']"] == f"P('stage', 'tensor', {embed})"
    assert specs["['params']['embed']"] == f"P('tensor', {embed})"
    assert specs["['params']['final_norm']['scale']"] == f"P({embed},)"
    # Adam's moments follow their parameter, so optimizer state is sharded the same way.
    moment_specs = {k: v for k, v in specs.items() if k.endswith(f".mu{wq}") or k.endswith(f".nu{wq}")}
    assert len(moment_specs) == 2
    assert set(moment_specs.values()) == {f"P('stage', {embed}, 'tensor', None)"}
    # And each device really holds only its shard: 1/(fsdp*tensor) of the matrix.
    wq_array = state["params"]["layers"]["attn"]["wq"]
    shard = wq_array.addressable_shards[0].data
    assert shard.size * 4 == wq_array.size


def planned_shardings(cfg):
    """The state's shapes and the shardings create_sharded_state initialises it into (no compile
    needed to read them), also as {keystr path: sharding}."""
    tx = optim.make_optimizer(cfg)
    rules, mesh = mesh_lib.rules_of(cfg.mesh), mesh_lib.make_mesh(cfg.mesh)
    shapes = jax.eval_shape(functools.partial(state_lib.init_state, cfg, tx), jax.random.key(0))
    shardings = state_lib.shardings(cfg, tx, mesh, rules, shapes)
    by_path = {jax.tree_util.keystr(path): s for path, s in jax.tree_util.tree_flatten_with_path(shardings)[0]}
    return shapes, shardings, by_path


@pytest.mark.parametrize("rule, spec", [(None, "P(None, ('fsdp', 'sequence'))"), ("tensor", "P('tensor', ('fsdp', 'sequence'))")],
                         ids=["default", "positions_on_tensor"])
def test_learned_position_table_is_sharded_as_the_rules_say(rule, spec):
    """[max_positions, D]: the embed dim over fsdp, like the token embedding's; the positions dim
    where the `positions` rule puts it (whole by default). Adam's moments follow."""
    cfg = load_config("tiny")
    cfg.mesh.update(data=2, fsdp=2, tensor=2)
    cfg.model.update(positions="learned", num_heads=8, num_kv_heads=4, d_model=64)
    cfg.mesh.rules = tuple((name, rule if name == "positions" else axes) for name, axes in cfg.mesh.rules)
    cfg = config_lib.resolve(cfg, jax.device_count())
    shapes, shardings, by_path = planned_shardings(cfg)
    tables = {path: str(s.spec) for path, s in by_path.items() if path.endswith("['pos_embed']")}
    assert len(tables) == 3 and set(tables.values()) == {spec}  # params, Adam's mu and nu
    assert shapes["params"]["pos_embed"].shape == (cfg.seq_len, 64)
    table_sharding = shardings["params"]["pos_embed"]
    assert table_sharding.shard_shape((cfg.seq_len, 64)) == (cfg.seq_len // (2 if rule else 1), 32)


def test_the_sequence_axis_splits_the_weights_and_their_moments_too():
    """With mesh.sequence > 1 its devices hold the same batch rows; the state is split over them as
    over fsdp (MaxText's rule), not replicated: fsdp 2 x sequence 2 x tensor 2 leaves each device
    1/8 of a layer's query projection and of its Adam moments."""
    cfg = load_config("tiny")
    cfg.mesh.update(data=1, fsdp=2, sequence=2, tensor=2)
    cfg.model.update(num_heads=8, num_kv_heads=4, d_model=64)
    shapes, _, by_path = planned_shardings(config_lib.resolve(cfg, jax.device_count()))
    wq = [s for path, s in by_path.items() if path.endswith("['layers']['attn']['wq']")]
    assert len(wq) == 3  # the parameter, Adam's mu and nu
    shape = shapes["params"]["layers"]["attn"]["wq"].shape  # [layers, D, H, Dh]
    assert {s.shard_shape(shape) for s in wq} == {(shape[0], 64 // 4, 8 // 2, shape[3])}


def test_rules_are_config_data():
    """Changing one rule in the config moves the parameter, no model change needed."""
    cfg = load_config("tiny")
    cfg.mesh.update(data=1, fsdp=8, tensor=1)
    cfg.mesh.rules = tuple(
        (name, None if name == "embed" else axes) for name, axes in cfg.mesh.rules
    )
    cfg = config_lib.resolve(cfg, jax.device_count())
    _, state = run(cfg, steps=1)
    assert mesh_lib.describe(state)["['params']['layers']['mlp']['w_up']"] == "P('stage', None, 'tensor')"


def test_bitwise_deterministic():
    cfg = mesh_config(2, 2, 2)
    first, state_a = run(cfg, steps=4)
    second, state_b = run(cfg, steps=4)
    np.testing.assert_array_equal(first, second)
    for a, b in zip(jax.tree.leaves(state_a["params"]), jax.tree.leaves(state_b["params"])):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# ----------------------------------------------------------------------------- hybrid meshes


def hybrid(devices, **mesh):
    cfg = config_lib.defaults().mesh
    cfg.update(data=1, fsdp=1, tensor=1)
    cfg.update(mesh)
    grid = mesh_lib.hybrid_device_grid(cfg, devices)
    owner = np.vectorize(lambda d: d.process_index)(grid)
    parts = [mesh_lib.grid_batch_parts(grid, config_lib.MESH_AXES, ("data", "fsdp"), p)
             for p in sorted(set(owner.flat))]
    return owner, parts


def test_hybrid_mesh_puts_each_process_in_one_contiguous_block_of_data():
    # 2 processes x 4 devices, data=2 across them (dcn_data=2), fsdp=4 inside each
    owner, parts = hybrid(fake_devices(2, 4), data=2, dcn_data=2, fsdp=4)
    assert owner.shape == (1, 2, 4, 1, 1, 1)  # (stage, data, fsdp, expert, sequence, tensor)
    assert (owner[0, 0] == 0).all() and (owner[0, 1] == 1).all()  # process p = data row p, whole
    assert parts == [((0,), 2), ((1,), 2)]  # so it reads rows [p*B/2, (p+1)*B/2)
    # 4 processes x 2 devices on a 2 x 2 grid of granules: each a contiguous [1, 2] block
    owner, parts = hybrid(fake_devices(4, 2), data=2, dcn_data=2, fsdp=4, dcn_fsdp=2)
    np.testing.assert_array_equal(owner[0, ..., 0, 0, 0], [[0, 0, 1, 1], [2, 2, 3, 3]])
    assert parts == [((p,), 4) for p in range(4)]
    # fsdp split across processes under an in-process data axis: each process holds two
    # separate quarters of the batch, and reads exactly those
    owner, parts = hybrid(fake_devices(2, 4), data=2, fsdp=4, dcn_fsdp=2)
    np.testing.assert_array_equal(owner[0, ..., 0, 0, 0], [[0, 0, 1, 1], [0, 0, 1, 1]])
    assert parts == [((0, 2), 4), ((1, 3), 4)]
    # expert split across 2 processes (dcn_expert=2), fsdp=4 inside each: the batch is split over
    # (data, fsdp, expert), expert minor, so each process holds (and reads) every other eighth of it
    devices = fake_devices(2, 4)
    owner, _ = hybrid(devices, fsdp=4, expert=2, dcn_expert=2)
    assert owner.shape == (1, 1, 4, 2, 1, 1)
    np.testing.assert_array_equal(owner[0, 0, :, :, 0, 0], [[0, 1]] * 4)
    cfg = config_lib.defaults().mesh
    cfg.update(data=1, fsdp=4, expert=2, dcn_expert=2, tensor=1)
    grid = mesh_lib.hybrid_device_grid(cfg, devices)
    assert [mesh_lib.grid_batch_parts(grid, config_lib.MESH_AXES, ("data", "fsdp", "expert"), p) for p in (0, 1)] \
        == [((0, 2, 4, 6), 8), ((1, 3, 5, 7), 8)]
    # a plain mesh with tensor across both processes: each holds (and reads) every row
    grid = np.array(fake_devices(2, 4), dtype=object).reshape(1, 1, 1, 1, 1, 8)
    assert mesh_lib.grid_batch_parts(grid, config_lib.MESH_AXES, ("data", "fsdp"), 1) == ((0,), 1)


def test_granules_are_tpu_slices_or_processes():
    assert mesh_lib.num_granules(fake_devices(4, 2)) == 4  # CPU/GPU: processes
    tpu = [FakeDevice(i, i // 2, platform="tpu", device_kind="TPU v5p", slice_index=i // 4)
           for i in range(8)]
    assert mesh_lib.num_granules(tpu) == 2  # 4 hosts in 2 slices


def test_dcn_factors_that_do_not_match_the_granules_are_a_config_error():
    cfg = load_config("tiny")
    cfg.mesh.update(data=2, fsdp=4, dcn_data=2)
    cfg = config_lib.resolve(cfg, jax.device_count())  # granules unknown: not checked here
    with pytest.raises(config_lib.ConfigError, match="= 2 must equal the number of granules, 1"):
        mesh_lib.make_mesh(cfg.mesh)  # ... but where the mesh is built
