"""bench/bench_sampling.py's ablations on the CPU: each replaces what it names in the compiled sampled step."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))

import bench_sampling  # noqa: E402
from dflash_jax.ops import topk  # noqa: E402
from dflash_jax.runtime.engine import Engine, EngineConfig  # noqa: E402
from dflash_jax.runtime.sampling import SamplingFlags  # noqa: E402
from dflash_jax.tiny import random_drafter, random_target, tiny_drafter_config, tiny_target_config  # noqa: E402


def test_ablations_compile_the_sampled_step_without_what_they_replace():
    tcfg = tiny_target_config(num_layers=2)
    engine = Engine(random_target(tcfg, seed=0),
                    random_drafter(tiny_drafter_config(tcfg, block_size=4), seed=1),
                    EngineConfig(max_batch_size=2, max_length=48, prompt_buckets=(16,)))
    params = bench_sampling.MODES["sampled"][0]
    flags = SamplingFlags.of([params], engine.config.max_logprobs)
    state = bench_sampling.sampled_state(engine, 2, 8, params)

    def hlo(patches=()) -> str:
        with contextlib.ExitStack() as stack:
            for patch in patches:
                stack.enter_context(patch)
            return engine.derive().decode_compiled(state, 1, sampling=flags).as_text()

    assert " conditional(" in hlo()
    for name, patches in bench_sampling.ABLATIONS.items():
        if "no conditionals" in name:
            assert " conditional(" not in hlo(patches), name
    # The top-k stand-in: each row's argmax, its first k entries as the candidates.
    x = jnp.asarray(np.random.RandomState(0).randn(3, 2, 50).astype(np.float32))
    values, ids, argmax = bench_sampling._argmax_top_k(x, 4)
    np.testing.assert_array_equal(np.asarray(argmax), np.argmax(np.asarray(x), -1))
    np.testing.assert_array_equal(np.asarray(values), np.asarray(x[..., :4]))
    assert ids.shape == (3, 2, 4) and topk.top_k_and_argmax is not bench_sampling._argmax_top_k


def test_no_cub_ablation_keeps_the_decode_options_and_turns_cub_sorts_off(monkeypatch):
    """On a GPU: the decode loop's own options (its CUDA graphs) plus XLA's sort kernels for every sort."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    (patch,) = bench_sampling.ABLATIONS["sampled, no CUB sorts"]
    from dflash_jax.runtime import engine as engine_module

    base = engine_module._decode_compiler_options()
    with patch:
        options = engine_module._decode_compiler_options()
    assert options == {**base, "xla_gpu_enable_cub_radix_sort": False}
    assert "WHILE" in options["xla_gpu_enable_command_buffer"]
