"""The engine's GPU paths against its XLA reference paths.

On one GPU a decode token takes paths the CPU never runs compiled: the QKV and output projections
as split-K partials, the norms folded into the matmuls with row scales in the kernels, the fused
cached attention; a prefill takes cuDNN's flash attention. In float32 (``highest`` precision) every
path must give the XLA engine's tokens exactly; in bf16 the logits must stay within bf16 rounding of
a float32 reference, as XLA's own bf16 path does.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import Engine, EngineConfig, load_drafter, load_target
from dflash_jax.models.target import Target
from dflash_jax.ops import OpsConfig
from dflash_jax.ops.cache import KVCache
from dflash_jax.ops.config import XLA
from dflash_jax.runtime.serving_params import serving_target
from dflash_jax.sharding import MeshConfig
from dflash_jax.tiny import random_target, tiny_target_config, write_copycat_pair

pytestmark = pytest.mark.gpu

# head_dim 32 and power-of-two blocks: shapes the compiled kernels take (head_dim 16 falls back to XLA)
COPYCAT_SHAPE = dict(hidden_size=128, intermediate_size=256, num_heads=4, num_kv_heads=4, head_dim=32,
                     vocab_size=512, num_layers=4)
CONFIG = EngineConfig(max_batch_size=4, max_length=160, steps_per_sync=4)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A float32 pair with varied acceptance lengths (``write_copycat_pair``)."""
    target_dir, drafter_dir = write_copycat_pair(tmp_path_factory.mktemp("copycat"), block_size=8,
                                                 shape=COPYCAT_SHAPE)
    return load_target(target_dir), load_drafter(drafter_dir)


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [rng.integers(0, 500, n).tolist() for n in (5, 37, 90, 12)]


def generations(engine: Engine, prompts, new_tokens: int = 48):
    return [(r.output_ids, r.acceptance_lengths) for r in engine.generate(prompts, new_tokens)]


@pytest.fixture(scope="module")
def xla_runs(models, prompts):
    """The XLA engine's generations (no kernels), DFlash and target-only."""
    config = dataclasses.replace(CONFIG, attention_impl="xla")
    return {name: generations(Engine(models[0], drafter, config), prompts)
            for name, drafter in (("dflash", models[1]), ("target_only", None))}


@pytest.mark.parametrize("tiles,lowering", [("", "triton"), ("block_k=32,num_stages=2", "triton"),
                                            ("min_chunk=64,num_warps=8", "triton"), ("", "mosaic")])
def test_kernel_engine_equals_xla_engine(models, prompts, xla_runs, tiles, lowering):
    """With the Pallas kernels (and a tile config of the cached attention; or on the Mosaic GPU
    lowering): the XLA engine's tokens and acceptance lengths, DFlash and target-only; and DFlash's
    tokens are target-only greedy's."""
    config = dataclasses.replace(CONFIG, attention_impl="pallas", cached_attention_tiles=tiles,
                                 gpu_lowering=lowering)
    dflash = generations(Engine(models[0], models[1], config), prompts)
    assert dflash == xla_runs["dflash"]
    assert generations(Engine(models[0], None, config), prompts) == xla_runs["target_only"]
    assert [ids for ids, _ in dflash] == [ids for ids, _ in xla_runs["target_only"]]
    assert any(max(lengths) > 1 for _, lengths in dflash)  # drafts were accepted: verify blocks ran


@pytest.mark.parametrize("axis", ["tensor", "data"])
def test_sharded_kernel_engine_equals_one_device(models, prompts, xla_runs, axis):
    """The kernels per device under a mesh of every GPU (``sharding.shard_kernel``): the one-device XLA
    engine's tokens and acceptance lengths."""
    n = jax.device_count()
    if n < 2:
        pytest.skip("needs 2 or more GPUs")
    if axis == "tensor" and COPYCAT_SHAPE["num_kv_heads"] % n:
        n = 2
    mesh = MeshConfig(data=n if axis == "data" else 1, fsdp=1, tensor=n if axis == "tensor" else 1)
    config = dataclasses.replace(CONFIG, attention_impl="pallas", mesh=mesh)
    assert generations(Engine(models[0], models[1], config), prompts) == xla_runs["dflash"]


def bf16_target() -> Target:
    """Qwen3-8B's heads (32 / 8 of 128) on a narrower, shallower bf16 target."""
    config = tiny_target_config(vocab_size=4096, hidden_size=1024, intermediate_size=3072, num_layers=3,
                                num_heads=32, num_kv_heads=8, head_dim=128, rope_theta=1e6)
    return random_target(config, std=0.03, dtype=jnp.bfloat16)


def float32_copy(target: Target) -> Target:
    copy = Target(target.config, dtype=jnp.float32, rngs=nnx.Rngs(0))
    nnx.update(copy, jax.tree.map(lambda x: x.astype(jnp.float32), nnx.state(target, nnx.Param)))
    return copy


def jitted(module: nnx.Module, fn):
    """``fn(module, *args)`` jitted with the module's arrays as arguments (not baked-in constants)."""
    graph, state = nnx.split(module)
    run = jax.jit(lambda state, *args: fn(nnx.merge(graph, state), *args))
    return lambda *args: run(state, *args)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.max(np.abs(got - want)) / np.max(np.abs(want)))


@pytest.mark.parametrize("lowering", ["triton", "mosaic"])
def test_serving_layout_decode_and_verify_logits_within_bf16_rounding(lowering):
    """A decode token and a 16-token verify block after a 256-token prefill, through the serving
    layout (fused projections, folded norms) with the kernels on (split-K partials, row scales, the
    cached attention; cuDNN prefill), on either GPU lowering, against a float32 forward of the same
    weights: no further from it than twice XLA's own bf16 forward of the checkpoint layout."""
    target, context = bf16_target(), 256
    c = target.config
    ids = jax.random.randint(jax.random.key(7), (1, context + 16), 0, c.vocab_size, jnp.int32)

    def kernel_logits(served, ids):
        cache = KVCache.zeros(c.num_layers, 1, 1152, c.num_kv_heads, c.head_dim, jnp.bfloat16)
        zeros, ops = jnp.zeros((1,), jnp.int32), OpsConfig(attention="pallas", gpu_lowering=lowering)
        _, _, cache = served.step(ids[:, :context], zeros, cache, ops=ops, prefill=True)
        one, _, _ = served.step(ids[:, context:context + 1], zeros + context, cache, ops=ops)
        block, _, _ = served.step(ids[:, context:], zeros + context, cache, ops=ops)
        return served.head(one[0]), served.head(block[0])

    def forward_logits(t, ids):
        return t.forward(ids, ops=XLA)[0][0, context:]

    with jax.default_matmul_precision("highest"):
        want = np.asarray(jitted(float32_copy(target), forward_logits)(ids))
    xla_bf16 = jitted(target, forward_logits)(ids)
    decode, verify = jitted(serving_target(target), kernel_logits)(ids)
    budget = 2 * relative_error(xla_bf16, want) + 2e-3
    assert relative_error(decode, want[:1]) < budget, (relative_error(decode, want[:1]), budget)
    assert relative_error(verify, want) < budget, (relative_error(verify, want), budget)


def test_prefill_with_cudnn_writes_the_reference_caches():
    """``Engine.prefill`` of three prompts with the kernels on (cuDNN's prompt attention) against the
    XLA engine: every layer's K and V of the prompt positions within bf16 rounding, and at least two
    of the three first tokens equal (random weights leave some near-ties)."""
    target = bf16_target()
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 4096, n).tolist() for n in (300, 77, 1)]
    states = {}
    for impl in ("pallas", "xla"):
        engine = Engine(target, None, EngineConfig(max_batch_size=4, max_length=512, attention_impl=impl))
        states[impl] = engine.prefill(prompts, [1] * 3, [()] * 3)
    (got, got_first), (want, want_first) = states["pallas"], states["xla"]
    for layer in range(target.config.num_layers):
        for name in ("k", "v"):
            g, w = getattr(got.target_cache, name)[layer], getattr(want.target_cache, name)[layer]
            for row, n in enumerate(map(len, prompts)):
                assert relative_error(g[row, :n], w[row, :n]) < 2e-2, (layer, name, row)
    assert np.mean(np.asarray(got_first)[:3] == np.asarray(want_first)[:3]) >= 2 / 3
