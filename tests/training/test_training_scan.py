"""The frozen target's layers stacked once and run under ``lax.scan`` (training's target forward)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax.models.target import init_stacked, scan_depth, scanned_forward, stack_layers, unstack_layers
from dflash_jax.ops.config import OpsConfig
from dflash_jax.tiny import random_target, tiny_target_config

N_LAYERS = 5


@pytest.fixture(scope="module")
def target():
    return random_target(tiny_target_config(num_layers=N_LAYERS), seed=0, dtype=jnp.float32)


def _ids(batch=2, seq=24):
    return jnp.asarray(np.random.default_rng(0).integers(0, 90, (batch, seq)), jnp.int32)


@pytest.mark.parametrize("taps", [(1, 3), (0, 2, N_LAYERS - 1), (N_LAYERS - 1,), (3, 1)])
def test_scanned_forward_equals_target_forward(target, taps):
    """Taps (HF ``hidden_states[lid + 1]``, the last layer's final-normed) and logits equal the
    unrolled ``Target.forward``'s, with and without the last layer among the taps."""
    graphdef, state = nnx.split(target)
    graph, params = stack_layers(target)
    ids = _ids()
    want_logits, want_taps = jax.jit(lambda s: nnx.merge(graphdef, s).forward(ids, tap_layers=taps))(state)
    for logits in (False, True):
        got_logits, got_taps = jax.jit(lambda p: scanned_forward(graph, p, ids, tap_layers=taps, logits=logits))(params)
        assert got_taps.shape == (2, 24, len(taps) * target.config.hidden_size)
        np.testing.assert_allclose(np.asarray(got_taps), np.asarray(want_taps), rtol=1e-5, atol=1e-5)
        if logits:
            np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-5, atol=1e-5)
        else:
            assert got_logits is None


def test_scanned_forward_with_tpu_flash_attention(target, tpu_flash_interpreted):
    """Training's target forward with the kernels on (``OpsConfig(attention="pallas")``) on a TPU: each scanned layer's
    prompt attention is JAX's Pallas TPU flash attention (interpret mode), and the taps and logits
    equal the XLA forward's."""
    graph, params = stack_layers(target)
    ids = _ids()
    want_logits, want_taps = jax.jit(lambda p: scanned_forward(graph, p, ids, tap_layers=(1, 3), logits=True))(params)
    got_logits, got_taps = jax.jit(lambda p: scanned_forward(graph, p, ids, tap_layers=(1, 3), logits=True,
                                                             ops=OpsConfig(attention="pallas")))(params)
    assert tpu_flash_interpreted  # traced once, in the scan's body
    # float32: an online softmax rounds unlike the exact one (taps differ by <= 2e-5, logits reach ~12)
    np.testing.assert_allclose(np.asarray(got_taps), np.asarray(want_taps), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(got_logits), np.asarray(want_logits), rtol=1e-4, atol=1e-4)


def _scan_lengths(fn, *args):
    return [eqn.params["length"] for eqn in jax.make_jaxpr(fn)(*args).eqns if eqn.primitive.name == "scan"]


def test_scan_stops_at_the_deepest_tap(target):
    """Without logits the later layers are not run at all; with logits (distillation) all are."""
    graph, params = stack_layers(target)
    ids = _ids()
    for taps, logits, want in [((0, 2), False, 3), ((1,), False, 2), ((0, 2), True, N_LAYERS),
                               ((N_LAYERS - 1,), False, N_LAYERS)]:
        assert scan_depth(N_LAYERS, taps, logits) == want
        lengths = _scan_lengths(lambda p: scanned_forward(graph, p, ids, tap_layers=taps, logits=logits), params)
        assert lengths == [want], (taps, logits, lengths)


def test_stacked_state_round_trips_and_shards_by_logical_axes(target):
    """Stacking adds a leading ``layers`` axis (mapped to no mesh axis), keeps the other logical
    axes for tensor parallelism, leaves the target untouched, and unstacks to the same module."""
    from dflash_jax.training import parallel
    from dflash_jax.training.config import MeshConfig

    graph, params = stack_layers(target)
    assert len(target.layers) == N_LAYERS  # the caller's module is not modified
    flat = dict(nnx.to_flat_state(params.layers))
    q = flat[("self_attn", "q_proj")]
    assert q.get_value().shape[0] == N_LAYERS
    assert q.get_metadata()["axes"] == ("layers", "embed", "heads", "head_dim")
    assert "layers" not in {k[0] for k in nnx.to_flat_state(params.shell)}

    if jax.device_count() >= 2:
        mesh = parallel.make_mesh(MeshConfig(data=1, fsdp=1, tensor=2), jax.devices()[:2])
        shardings = dict(nnx.to_flat_state(parallel.state_shardings(params.layers, mesh, "target")))
        assert tuple(shardings[("self_attn", "q_proj")].get_value().spec) == (None, None, "tensor", None)
        assert tuple(shardings[("mlp", "down_proj")].get_value().spec) == (None, "tensor", None)

    back = unstack_layers(graph, params)
    a, b = nnx.state(back, nnx.Param), nnx.state(target, nnx.Param)
    assert jax.tree.structure(a) == jax.tree.structure(b)
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_init_stacked_matches_stack_layers_layout():
    """The benchmark's directly-stacked random target has exactly ``stack_layers``'s layout."""
    cfg = tiny_target_config(num_layers=3)
    graph, params = init_stacked(cfg, dtype=jnp.bfloat16, seed=0)
    ref_graph, ref_params = stack_layers(random_target(cfg, seed=0, dtype=jnp.bfloat16))
    assert graph == ref_graph
    assert jax.tree.structure(params) == jax.tree.structure(ref_params)
    for x, y in zip(jax.tree.leaves(params), jax.tree.leaves(ref_params)):
        assert (x.shape, x.dtype) == (y.shape, y.dtype)
    norms = dict(nnx.to_flat_state(params.layers))[("input_layernorm", "weight")].get_value()
    np.testing.assert_array_equal(np.asarray(norms, np.float32), 1.0)  # a real layer initialisation
    layers = dict(nnx.to_flat_state(params.layers))[("mlp", "up_proj")].get_value()
    assert not np.array_equal(np.asarray(layers[0], np.float32), np.asarray(layers[1], np.float32))


@pytest.mark.slow
def test_train_step_scanned_equals_unrolled():
    """One distillation train step (teacher logits from all layers, taps from the scan) gives the
    same loss and updated drafter weights with the scanned and the unrolled target."""
    from dflash_jax.tiny import random_drafter, tiny_drafter_config
    from dflash_jax.training.config import OptimConfig
    from dflash_jax.training.optim import make_optimizer
    from dflash_jax.training.trainer import StepSpec, init_state, make_train_step, split_drafter, split_target

    tcfg = tiny_target_config(num_layers=4)
    dcfg = tiny_drafter_config(tcfg, block_size=4, num_layers=1)
    ids = _ids(2, 24)
    batch = {"input_ids": ids, "loss_mask": jnp.ones_like(ids).at[:, :5].set(0), "segment_ids": jnp.ones_like(ids)}
    spec = StepSpec(block_size=4, mask_token_id=dcfg.mask_token_id, target_layer_ids=dcfg.target_layer_ids,
                    num_anchors=8, kind="kl", compute_dtype=jnp.float32)
    tx = make_optimizer(OptimConfig(lr=1e-2), 10)
    results = []
    for scan in (True, False):
        graph, params = split_target(random_target(tcfg, seed=0), scan=scan)
        gd, dparams, rest = split_drafter(random_drafter(dcfg, seed=1))
        step = jax.jit(make_train_step(gd, rest, graph, tx, spec))
        state, metrics = step(init_state(dparams, tx), params, batch)
        results.append((float(metrics["loss"]), jax.tree.leaves(state.params)))
    (l_scan, p_scan), (l_unrolled, p_unrolled) = results
    assert np.isfinite(l_scan) and l_scan > 0
    np.testing.assert_allclose(l_scan, l_unrolled, rtol=1e-5)
    for a, b in zip(p_scan, p_unrolled):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
