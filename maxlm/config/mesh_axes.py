"""The mesh's six axes, the logical-axis rules that map onto them, and the checks a config's
mesh must pass (part of `config.resolve`) before anything is compiled.

Plain data and arithmetic, no JAX: `maxlm/sharding/mesh.py` builds the jax Mesh from the resolved sizes.
"""

from __future__ import annotations

import math

from maxlm.runtime.errors import ConfigError

# Logical axis names → mesh axes. Parameters and activations are annotated with the logical names
# on the left; a mesh sweep edits this table (or the mesh sizes), never the model.
DEFAULT_RULES = (
    # activations' batch dim: data parallel, fully-sharded DP, and the expert axis, which outside the
    # MoE layers is data parallelism too (MaxText's rule)
    ("batch", ("data", "fsdp", "expert")),
    ("experts", "expert"),  # MoE weights' experts dim: expert parallelism (maxlm/model/moe/expert_parallel.py)
    # weights' d_model dim: ZeRO-3 (weights, grads and Adam state sharded), over the sequence axis
    # too (MaxText's rule): its devices hold the same batch rows and would otherwise each keep a
    # whole replica of the state, whose gradients they all-reduce instead of reduce-scatter
    ("embed", ("fsdp", "sequence")),
    ("heads", "tensor"), ("kv_heads", "tensor"), ("mlp", "tensor"), ("vocab", "tensor"),  # Megatron
    ("head_dim", None),
    # multi-head latent attention's latent dims (maxlm/model/mla.py): sharded like `embed` in the
    # up-projections, which have no embed dim; whole in the down-projections, which do
    ("latent", ("fsdp", "sequence")),
    ("positions", None),  # the learned position table's rows (model.positions="learned"): whole
    ("layers", "stage"),  # the scanned layers' axis: pipeline stages, each holding its layers
    ("length", "sequence"),  # activations' sequence dim: sequence parallelism
    ("act_embed", None),  # activations' d_model dim stays whole: sharding it would add collectives
)

# Outermost (slowest links) first. `expert` sits inside data and fsdp: its all-gathers/all-to-alls
# carry every MoE layer's tokens, forward and backward, on the critical path (fsdp's weight gathers
# can overlap compute), so it belongs on ICI/NVLink within a slice or node; `sequence` and `tensor`,
# whose collectives come with every attention block or matmul, stay innermost.
MESH_AXES = ("stage", "data", "fsdp", "expert", "sequence", "tensor")
DCN_AXES = ("data", "fsdp", "expert")  # axes that may span granules: mesh.dcn_data, dcn_fsdp, dcn_expert
BATCH_AXES = ("data", "fsdp", "expert")  # the default rules' batch split: what batch_size must divide by


def resolve_mesh_shape(mesh_cfg, num_devices: int) -> dict[str, int]:
    """Fills the one optional -1 so that stage × data × fsdp × expert × sequence × tensor == num_devices
    (each size already in its domain, a positive int or -1: `config.resolve` checks that first)."""
    sizes = {axis: mesh_cfg[axis] for axis in MESH_AXES}
    fill = [axis for axis, size in sizes.items() if size == -1]
    if len(fill) > 1:
        raise ConfigError(
            f"only one mesh axis may be -1, got {', '.join('mesh.' + a for a in fill)} = -1"
        )
    known = math.prod(size for size in sizes.values() if size != -1)
    if fill:
        if num_devices % known:
            raise ConfigError(
                f"mesh.{fill[0]}=-1 cannot be filled: the other axes multiply to {known}, "
                f"which does not divide the {num_devices} devices"
            )
        sizes[fill[0]] = num_devices // known
    product = math.prod(sizes.values())
    if product != num_devices:
        shape = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ConfigError(
            f"mesh {shape} has {product} devices but {num_devices} are available; "
            f"make the product {num_devices} or set one axis to -1"
        )
    return sizes


def check_dcn(mesh_cfg, num_granules: int | None = None) -> None:
    """`mesh.dcn_data` / `dcn_fsdp` / `dcn_expert` against the resolved mesh and, when known, the number of
    granules (TPU slices; processes on GPU/CPU) the devices come in. The sizes are positive ints
    (their domain, checked by `config.resolve`)."""
    dcn = {axis: mesh_cfg[f"dcn_{axis}"] for axis in DCN_AXES}
    for axis, size in dcn.items():
        if mesh_cfg[axis] % size:
            raise ConfigError(
                f"mesh.dcn_{axis}={size} must divide mesh.{axis}={mesh_cfg[axis]} (mesh.{axis} = "
                f"dcn_{axis} granules x mesh.{axis}/dcn_{axis} devices within each)"
            )
    if num_granules is not None and (product := math.prod(dcn.values())) > 1 and product != num_granules:
        raise ConfigError(
            f"{' x '.join('mesh.dcn_' + a for a in dcn)} = {' x '.join(map(str, dcn.values()))} = {product} "
            f"must equal the number of granules, {num_granules} (TPU slices; processes on GPU/CPU)"
        )


def check_mesh(c, num_devices: int, num_granules: int | None) -> None:
    """Fills the mesh's -1; the batch, heads and widths against the mesh axes; sequence and
    pipeline parallelism; the rules."""
    m, accum = c.model, c.optim.grad_accum_steps
    mesh = resolve_mesh_shape(c.mesh, num_devices)
    c.mesh.update(mesh)
    check_dcn(c.mesh, num_granules)
    batch_shards = math.prod(mesh[a] for a in BATCH_AXES)
    if c.batch_size % batch_shards:
        raise ConfigError(f"batch_size={c.batch_size} must be divisible by {_product(mesh)}")
    if c.batch_size % (accum * batch_shards):
        raise ConfigError(
            f"batch_size={c.batch_size} must be divisible by {_product(mesh, {'optim.grad_accum_steps': accum})} "
            "(each microbatch is split evenly over the data-parallel devices)"
        )
    _check_expert(c, mesh["expert"])
    _check_sequence(c, mesh["sequence"])
    _check_pipeline(c, mesh)
    tensor = mesh["tensor"]
    for key in ("num_heads", "num_kv_heads", "mlp_dim", "vocab_size"):
        if m[key] % tensor:
            raise ConfigError(f"model.{key}={m[key]} must be divisible by mesh.tensor={tensor}")
    check_rules(c.mesh.rules)
    embed = rule_axes(c.mesh.rules, "embed")
    if m.d_model % math.prod(mesh[a] for a in embed):
        raise ConfigError(f"model.d_model={m.d_model} must be divisible by "
                          f"{_product(mesh, axes=embed)} (mesh.rules split the weights' d_model dim over them)")


def _product(mesh, factors: dict | None = None, axes: tuple[str, ...] = BATCH_AXES) -> str:
    """"optim.grad_accum_steps x mesh.data x mesh.fsdp x mesh.expert = 2 x 1 x 4 x 2 = 16": the batch's
    split (or `axes`') spelled out, `factors` ({key: size}) before the mesh axes."""
    named = {**(factors or {}), **{f"mesh.{a}": mesh[a] for a in axes}}
    return f"{' x '.join(named)} = {' x '.join(map(str, named.values()))} = {math.prod(named.values())}"


def _check_expert(c, expert: int):
    """Expert parallelism (`mesh.expert` > 1): each device holds num_experts / expert experts."""
    m = c.model
    if expert == 1:
        return
    if not m.num_experts:
        raise ConfigError(f"mesh.expert={expert} > 1 needs a mixture-of-experts model (model.num_experts > 0); "
                          "for a dense model put these devices on mesh.data or mesh.fsdp")
    if m.num_experts % expert:
        raise ConfigError(f"model.num_experts={m.num_experts} must be divisible by mesh.expert={expert} "
                          "(each device holds the same number of experts)")


def _check_sequence(c, sequence: int):
    """Sequence parallelism (`mesh.sequence` > 1): each device holds seq_len / sequence positions of
    every activation. Attention all-gathers keys and values (XLA only), passes them around a ring
    (XLA, splash or cuDNN per block), or (Ulysses) trades the length split for a heads split."""
    if sequence == 1:
        return
    if c.seq_len % sequence:
        raise ConfigError(
            f"seq_len={c.seq_len} must be divisible by mesh.sequence={sequence} (each device holds "
            f"seq_len / mesh.sequence positions)"
        )
    if c.model.context_parallel == "ulysses":
        return  # each device attends over whole rows: every backend applies (config_rules checks the heads)
    ring = c.model.context_parallel == "ring"
    if c.model.attention in ("cudnn", "splash") and not ring:
        raise ConfigError(
            f"model.attention={c.model.attention!r} does not support mesh.sequence={sequence} > 1 "
            "with model.context_parallel=" f"{c.model.context_parallel!r} (its kernel needs the whole sequence "
            "on each device); use model.attention='xla' or 'auto', or model.context_parallel='ulysses' or "
            "'ring' (the kernel per ring block)")
    if not ring:  # the ring runs splash or cuDNN per block (ring_attention.block_backend)
        c.model.attention = "xla"  # what "auto" means under the all-gather strategy


def _check_pipeline(c, mesh):
    """Pipeline parallelism (`mesh.stage` > 1): N/(S·R) layers per chunk, R chunks per stage, a
    GPipe (R = 1) or circular schedule over `model.pipeline_microbatches` microbatches of each
    (accumulation) microbatch."""
    m, stages, micro, repeats = c.model, mesh["stage"], c.model.pipeline_microbatches, c.model.pipeline_repeats
    if stages == 1:
        if repeats > 1:
            raise ConfigError(f"model.pipeline_repeats={repeats} > 1 needs mesh.stage > 1 (a circular "
                              "pipeline loops the microbatches around the stages)")
        return
    chunks = f"mesh.stage={stages}" if repeats == 1 else \
        f"mesh.stage x model.pipeline_repeats = {stages} x {repeats} = {stages * repeats}"
    if m.num_layers % (stages * repeats):
        raise ConfigError(
            f"model.num_layers={m.num_layers} must be divisible by {chunks} "
            "(each pipeline stage holds the same number of layers)"
        )
    if m.num_experts and m.first_dense_layers % (stages * repeats):
        raise ConfigError(
            f"model.first_dense_layers={m.first_dense_layers} must be divisible by {chunks} "
            "(the dense layers, then the MoE layers, are each split evenly over the pipeline stages)"
        )
    if repeats > 1 and micro < stages:
        raise ConfigError(
            f"model.pipeline_microbatches={micro} must be >= mesh.stage={stages} with "
            f"model.pipeline_repeats={repeats} > 1 (a microbatch goes round the stages again only "
            "after it left the last one)"
        )
    if not m.scan_layers:
        raise ConfigError(f"mesh.stage={stages} > 1 needs model.scan_layers=True (stages split the "
                          "scanned layers)")
    shards = c.optim.grad_accum_steps * micro * math.prod(mesh[a] for a in BATCH_AXES)
    if c.batch_size % shards:
        factors = {"optim.grad_accum_steps": c.optim.grad_accum_steps, "model.pipeline_microbatches": micro}
        raise ConfigError(
            f"batch_size={c.batch_size} must be divisible by {_product(mesh, factors)} "
            "(each pipeline microbatch is split evenly over the data-parallel devices)"
        )


def rule_axes(rules, name: str) -> tuple[str, ...]:
    """The mesh axes `rules` map the logical axis `name` to (none if unnamed)."""
    axes = dict(rules).get(name)
    return () if axes is None else (axes,) if isinstance(axes, str) else tuple(a for a in axes if a)


def check_rules(rules):
    names = set()
    for rule in rules:
        if len(rule) != 2 or not isinstance(rule[0], str):
            raise ConfigError(f"mesh.rules entries must be (logical_name, mesh_axes), got {rule!r}")
        name, axes = rule
        if name in names:
            raise ConfigError(f"mesh.rules names {name!r} twice")
        names.add(name)
        for axis in (axes,) if isinstance(axes, str) or axes is None else axes:
            if axis is not None and axis not in MESH_AXES:
                raise ConfigError(
                    f"mesh.rules maps {name!r} to unknown mesh axis {axis!r}; "
                    f"mesh axes are {MESH_AXES}"
                )
