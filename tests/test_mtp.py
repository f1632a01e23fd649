"""Multi-token prediction (maxlm/model/mtp.py): depth 1 against a reference, packed documents kept
apart, both layer layouts alike, the main head's losses and the eval untouched, the counts, the
training step's metrics and an exact resume, and the bad configs refused."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from maxlm import config as config_lib, model
from maxlm.eval import during_training
from maxlm.model import attention, mtp
from maxlm.observe import flops, metrics
from maxlm.runtime.errors import ConfigError
from maxlm.train import loop
from tests.helpers import load_config, losses, packed_batch, random_params, train_rows, with_overrides


def mtp_config(**overrides):
    return config_lib.resolve(with_overrides(load_config("tiny"), {"model.mtp_depth": 1, **overrides}),
                              jax.device_count())


def rms_norm(x, scale, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * scale


def reference_depth_1(cfg, p, batch):
    """Depth 1's mean cross-entropy, written out from DeepSeek-V3 §2.2 with float64 numpy around
    the model's own Block (checked against its own reference in tests/test_model.py): h^0 the
    trunk before the final norm, h^1 = Block([RMSNorm(h^0); RMSNorm(Emb(t_{i+1}))] @ M), logits =
    FinalNorm(h^1) @ head, target t_{i+2}; counted where t_{i+2} is in token i's document."""
    inputs, targets, segments, positions = (np.asarray(batch[k])
                                            for k in ("inputs", "targets", "segment_ids", "positions"))
    B, L = inputs.shape
    mask = attention.attention_mask(jnp.asarray(segments))
    block = lambda params, x: np.asarray(model.Block(cfg).apply({"params": params}, jnp.asarray(x, jnp.float32),
                                                                positions, mask, segments)[0], np.float64)
    f64 = jax.tree.map(lambda a: np.asarray(a, np.float64), p)
    x = f64["embed"][inputs]
    for i in range(cfg.num_layers):
        x = block(p[f"layer_{i}"], x)
    head = lambda h: rms_norm(h, f64["final_norm"]["scale"], cfg.norm_eps) @ (
        f64["embed"].T if cfg.tie_embeddings else f64["head"])
    np.testing.assert_allclose(head(x), model.apply(cfg, p, batch), atol=1e-4)  # x is the trunk the head reads
    m = f64["mtp_0"]
    both = np.concatenate([rms_norm(x, m["hidden_norm"]["scale"], cfg.norm_eps),
                           rms_norm(f64["embed"][targets], m["embed_norm"]["scale"], cfg.norm_eps)], -1)  # t_{i+1}
    logits = head(block(p["mtp_0"]["block"], both @ m["proj"]))
    shifted = logits - logits.max(-1, keepdims=True)
    log_p = shifted - np.log(np.exp(shifted).sum(-1, keepdims=True))
    total = count = 0.0
    for b in range(B):
        for i in range(L - 1):
            if segments[b, i] > 0 and segments[b, i + 1] == segments[b, i]:
                total -= log_p[b, i, targets[b, i + 1]]
                count += 1
    return total / count


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_depth_one_equals_a_reference(tied):
    cfg = mtp_config(**{"model.scan_layers": False, "model.tie_embeddings": tied}).model
    params = random_params(cfg, seed=1, std=0.1)
    batch = packed_batch(2, 32, cfg.vocab_size)
    objective, aux = jax.jit(functools.partial(model.loss_fn, cfg))(params, batch)
    want = reference_depth_1(cfg, params, batch)
    assert abs(float(aux["mtp"][0]) - want) <= 1e-5, (float(aux["mtp"][0]), want)
    assert float(objective) == pytest.approx(float(aux["cross_entropy"]) + 0.3 * want, abs=1e-5)


def test_depth_batch_counts_only_targets_in_the_tokens_document():
    batch = {"targets": jnp.array([[11, 12, 13, 21, 22, 0]]), "segment_ids": jnp.array([[1, 1, 1, 2, 2, 0]])}
    one, two = mtp.depth_batch(batch, 1), mtp.depth_batch(batch, 2)
    assert one["targets"].tolist() == [[12, 13, 21, 22, 0, 0]] and one["segment_ids"].tolist() == [[1, 1, 0, 2, 0, 0]]
    assert two["targets"].tolist() == [[13, 21, 22, 0, 0, 0]] and two["segment_ids"].tolist() == [[1, 0, 0, 0, 0, 0]]
    assert mtp.input_tokens(batch["targets"], 1).tolist() == batch["targets"].tolist()


def test_packed_documents_predict_as_they_do_alone():
    """Two documents packed in one row give each depth the loss sums they give alone: no target
    and no attention crosses the boundary, and a row's end is no document's."""
    cfg = mtp_config(**{"model.mtp_depth": 2}).model
    params = random_params(cfg, seed=2, std=0.1)
    rng = np.random.default_rng(0)
    tokens = rng.integers(3, cfg.vocab_size, (2, 16)).astype(np.int32)
    row = lambda cols, segments: {"inputs": tokens[0:1, cols], "targets": tokens[1:2, cols],
                                  "segment_ids": np.array([segments], np.int32),
                                  "positions": np.array([[c - cols.start for c in range(cols.start, cols.stop)]])}
    packed = row(slice(0, 16), [1] * 10 + [2] * 6)
    packed["positions"] = np.array([list(range(10)) + list(range(6))])
    loss = jax.jit(lambda b: model.loss_fn(cfg, params, b)[1]["mtp"])
    alone_a, alone_b = loss(row(slice(0, 10), [1] * 10)), loss(row(slice(10, 16), [1] * 6))
    for k in (1, 2):  # depth k counts n - k tokens of a document of n
        sums = (10 - k) * alone_a[k - 1] + (6 - k) * alone_b[k - 1]
        np.testing.assert_allclose(float(loss(packed)[k - 1]) * (16 - 2 * k), float(sums), rtol=1e-5)


def test_both_layouts_hold_the_same_modules_and_give_the_same_loss_and_gradients():
    unrolled = mtp_config(**{"model.mtp_depth": 2, "model.scan_layers": False}).model
    scanned = mtp_config(**{"model.mtp_depth": 2, "model.remat": "full"}).model
    params = random_params(unrolled, seed=3)
    batch = packed_batch(2, 32, unrolled.vocab_size)
    grad_of = lambda cfg: jax.jit(jax.value_and_grad(lambda p: model.loss_fn(cfg, p, batch)[0]))
    (loss_u, grads_u), (loss_s, grads_s) = grad_of(unrolled)(params), grad_of(scanned)(model.stack_layers(params))
    np.testing.assert_allclose(float(loss_s), float(loss_u), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(model.stack_layers(grads_u)), jax.tree.leaves(grads_s)):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-7)
    assert float(jnp.abs(grads_s["mtp_1"]["proj"]).max()) > 0  # the last depth is trained too
    for cfg in (unrolled, scanned):
        shapes = jax.eval_shape(functools.partial(model.init_params, cfg), jax.random.key(0))
        assert sorted(k for k in shapes if k.startswith("mtp")) == ["mtp_0", "mtp_1"]
        assert sum(x.size for x in jax.tree.leaves(shapes)) == model.count_params(cfg)
        specs = model.param_logical_specs(cfg)
        assert jax.tree.structure(specs, is_leaf=model.is_spec) == jax.tree.structure(shapes)
        assert specs["mtp_0"]["proj"] == jax.sharding.PartitionSpec(None, "embed")


def test_the_main_model_and_its_eval_are_unchanged_by_the_modules():
    """With the same main parameters: the same `loss` and eval numbers, bitwise, with the modules
    as without; the objective adds λ × the depths' mean."""
    plain, with_mtp = mtp_config(**{"model.mtp_depth": 0}).model, mtp_config(**{"model.mtp_depth": 2}).model
    params = random_params(with_mtp, seed=4)
    main = {k: v for k, v in params.items() if not k.startswith("mtp_")}
    batch = packed_batch(2, 32, plain.vocab_size)
    eval_of = lambda cfg, p: jax.device_get(jax.jit(functools.partial(during_training.eval_step, cfg))(p, batch))
    assert eval_of(with_mtp, params) == eval_of(plain, main)
    loss_of = lambda cfg, p: jax.jit(functools.partial(model.loss_fn, cfg))(p, batch)
    (objective, aux), (plain_objective, plain_aux) = loss_of(with_mtp, params), loss_of(plain, main)
    assert float(aux["cross_entropy"]) == float(plain_aux["cross_entropy"]) and "mtp" not in plain_aux
    assert float(objective) == pytest.approx(float(plain_objective) + 0.3 * float(aux["mtp"].mean()),
                                             rel=1e-6)


def test_parameters_and_flops_count_the_modules():
    """Each depth: one dense layer, its projection and two norms; in FLOPs its layer, projection and
    one more LM head. An MoE model's modules are dense layers too, all of them active."""
    cfg, plain = mtp_config(**{"model.mtp_depth": 2}).model, mtp_config(**{"model.mtp_depth": 0}).model
    deeper = mtp_config(**{"model.mtp_depth": 0, "model.num_layers": 3}).model
    D, V, T = cfg.d_model, cfg.vocab_size, 64
    layer = model.count_params(deeper) - model.count_params(plain)
    assert model.count_params(cfg) - model.count_params(plain) == 2 * (layer + 2 * D * D + 2 * D)
    assert model.active_params(cfg) == model.count_params(cfg)
    parts, base = flops.forward_flops_breakdown(cfg, T), flops.forward_flops_breakdown(plain, T)
    one_layer = sum(flops.forward_flops_breakdown(deeper, T)[p] - base[p]
                    for p in ("q_proj", "kv_proj", "out_proj", "mlp", "attention"))
    assert parts["total"] - base["total"] == 2 * (one_layer + 2 * 2 * D * D + 2 * D * V)
    assert parts["mtp_proj"] == 2 * 4 * D * D and base["mtp_proj"] == 0
    moe = {"model.num_experts": 4, "model.experts_per_token": 1, "model.first_dense_layers": 1}
    moe_mtp, moe_plain = mtp_config(**moe).model, mtp_config(**moe, **{"model.mtp_depth": 0}).model
    shapes = jax.eval_shape(functools.partial(model.init_params, moe_mtp), jax.random.key(0))
    assert "router" not in shapes["mtp_0"]["block"]["mlp"]
    assert sum(x.size for x in jax.tree.leaves(shapes)) == model.count_params(moe_mtp)
    added = model.count_params(moe_mtp) - model.count_params(moe_plain)
    assert model.active_params(moe_mtp) - model.active_params(moe_plain) == added == (layer + 2 * D * D + 2 * D)


@pytest.mark.ci
@pytest.mark.slow
def test_an_mtp_model_trains_with_grad_accumulation_and_resumes_exactly(tmp_path, data_dirs):
    """Through the training loop (checkpoints on): the MTP losses fall, go to
    metrics.jsonl and TensorBoard, and a resumed run repeats them bitwise."""
    overrides = {**data_dirs, "eval.every_steps": 0, "log_every_steps": 1, "checkpoint.every_steps": 2,
                 "model.mtp_depth": 2, "optim.grad_accum_steps": 2, "batch_size": 16, "optim.warmup_steps": 2}
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    loop.train_and_evaluate(mtp_config(**overrides, steps=4), str(whole))
    loop.train_and_evaluate(mtp_config(**overrides, steps=2), str(resumed))
    loop.train_and_evaluate(mtp_config(**overrides, steps=4), str(resumed))
    assert losses(resumed) == losses(whole) and sorted(losses(whole)) == list(range(1, 5))
    got, want = train_rows(resumed), train_rows(whole)
    names = ("mtp_loss", "mtp/loss_1", "mtp/loss_2")
    assert [[got[s][n] for n in names] for s in got] == [[want[s][n] for n in names] for s in want]
    assert want[1]["mtp_loss"] == pytest.approx((want[1]["mtp/loss_1"] + want[1]["mtp/loss_2"]) / 2, rel=1e-6)
    assert abs(want[1]["mtp_loss"] - np.log(264)) < 0.3 and want[4]["mtp_loss"] < want[1]["mtp_loss"] - 0.1
    from tensorboard.backend.event_processing import event_accumulator as ea

    events = ea.EventAccumulator(str(whole), size_guidance={ea.SCALARS: 0})
    events.Reload()
    assert [e.value for e in events.Scalars("mtp/loss")] == pytest.approx([want[s]["mtp_loss"] for s in sorted(want)])
    assert metrics.tensorboard_tag("mtp_loss") == "mtp/loss"


@pytest.mark.parametrize(("overrides", "message"), [
    ({"model.mtp_depth": 64}, r"model.mtp_depth=64 must be less than seq_len=64"),
    ({"model.mtp_depth": -1}, r"model.mtp_depth must be an int >= 0"),
    ({"model.mtp_loss_weight": -0.1}, r"model.mtp_loss_weight must be a finite number >= 0"),
])
def test_bad_mtp_configs_are_refused_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        mtp_config(**overrides)


def test_the_maxtext_comparison_refuses_mtp():
    from maxlm.bench import maxtext_peer

    with pytest.raises(ConfigError, match=r"model.mtp_depth > 0 \(MaxText's mtp_num_layers is not mapped"):
        maxtext_peer.check_expressible(mtp_config())
