"""The drafter's sliding context window (``EngineConfig.drafter_context_window``): a draft over each row's
last W context positions equals an independent masked computation (a DFlash2 drafter's sliding layers,
``windowed_block_attention`` over the whole cache), with the XLA attention and with the kernels
(interpret mode on the CPU); decoding with a window still gives target-only decoding's tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from dflash_jax import Engine, EngineConfig
from dflash_jax.models.dflash2 import DFlash2Drafter
from dflash_jax.ops.config import OpsConfig
from dflash_jax.runtime import decoding
from dflash_jax.runtime.sampling import SamplingFlags
from dflash_jax.runtime.serving_params import serving_drafter, serving_target
from dflash_jax.tiny import random_drafter, random_target, tiny_dflash2_config, tiny_drafter_config, tiny_target_config

WINDOW, BLOCK = 16, 8
LOGITS = SamplingFlags(rejection=True)  # draft_block then returns the draft logits too


@pytest.fixture(scope="module")
def setup():
    tcfg = tiny_target_config(num_layers=4)
    target = random_target(tcfg, seed=0)
    full_cfg = tiny_dflash2_config(tcfg, block_size=BLOCK)
    sliding_cfg = dataclasses.replace(full_cfg, layer_types=("sliding_attention",) * 2, sliding_window=WINDOW)
    sliding = random_drafter(sliding_cfg, seed=1)
    full = DFlash2Drafter(full_cfg, rngs=nnx.Rngs(0))
    nnx.update(full, nnx.state(sliding, nnx.Param))  # the same weights, every layer over the whole context
    rs = np.random.RandomState(0)
    lens = np.array([40, 13, 27], np.int32)  # one row shorter than the window
    ids = np.zeros((3, 48), np.int32)
    for i, n in enumerate(lens):
        ids[i, :n] = rs.randint(0, 90, n)
    # Compiled whole, as the engine runs it (op by op, every layer's small programs compile for every shape).
    state = jax.jit(lambda ids, lens: decoding.prefill(
        target, full, ids, lens, lens + 20, jnp.full((3, 2), -1, jnp.int32), capacity=128, max_steps=32,
        mask_token_id=full.config.mask_token_id))(jnp.asarray(ids), jnp.asarray(lens))
    return target, sliding, full, state


def _draft(target, drafter, state, **kwargs):
    """``draft_block`` compiled whole, as the engine's decode step runs it."""
    block_ids, _, _, logits = jax.jit(lambda s: decoding.draft_block(target, drafter, s, block_size=BLOCK, flags=LOGITS,
                                                                     **kwargs))(state)
    return np.asarray(block_ids), np.asarray(logits)


@pytest.mark.slow
def test_windowed_draft_equals_the_masked_sliding_layers(setup):
    target, sliding, full, state = setup
    want_ids, want = _draft(target, sliding, state)
    got_ids, got = _draft(target, full, state, context_window=WINDOW)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    np.testing.assert_array_equal(got_ids, want_ids)
    _, unbounded = _draft(target, full, state)
    assert not np.allclose(unbounded[0], want[0], atol=1e-3)  # the long row sees less with the window
    np.testing.assert_allclose(unbounded[1], want[1], rtol=1e-4, atol=1e-4)  # the short one the same
    _, wide = _draft(target, full, state, context_window=4096)  # a window past the capacity: none
    np.testing.assert_array_equal(wide, unbounded)


@pytest.mark.slow
def test_windowed_draft_with_the_kernels_equals_the_reference(setup):
    target, sliding, full, state = setup
    _, want = _draft(target, sliding, state)
    served_target, served = serving_target(target), serving_drafter(full)
    pallas = OpsConfig(attention="pallas")
    _, got = _draft(served_target, served, state, context_window=WINDOW, ops=pallas)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_engine_with_a_context_window_keeps_target_only_tokens(setup):
    tcfg = tiny_target_config(num_layers=4)
    target = random_target(tcfg, seed=0)
    drafter = random_drafter(tiny_drafter_config(tcfg, block_size=BLOCK), seed=1)
    prompts = [list(range(3, 43)), [5, 6, 7]]
    config = EngineConfig(max_batch_size=2, max_length=96, drafter_context_window=WINDOW, prompt_buckets=(64,))
    got = Engine(target, drafter, config).generate(prompts, 30)
    want = Engine(target, None, config).generate(prompts, 30)
    assert [r.output_ids for r in got] == [r.output_ids for r in want]
    with pytest.raises(ValueError, match="drafter_context_window"):
        EngineConfig(drafter_context_window=-1).validate()
