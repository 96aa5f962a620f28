"""The engine on mixture-of-experts targets: speculative = target-only = transformers' greedy generate,
on one device and on 8 CPU devices with the experts split (expert parallelism) beside tensor parallelism."""

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips

from dflash_jax import Engine, EngineConfig, load_drafter, load_target
from dflash_jax.sharding import MeshConfig
from copycat_fixtures import shallow_copycat_pair

MAX_NEW = 16


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def moe_pair(request, tmp_path_factory):
    """A copycat pair (varied acceptance) on a 2-layer MoE target of 8 experts, top-2 (Qwen3-MoE: layer 1
    dense; gpt-oss: a sliding layer of window 6 and a full one, sinks, YaRN; copycat_fixtures)."""
    return shallow_copycat_pair(tmp_path_factory.mktemp(request.param), model_type=request.param, noise=0.2,
                                shape=dict(num_experts=8))


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 95, n).tolist() for n in (3, 11, 7, 14)]  # within and past gpt-oss's window of 6


@pytest.fixture(scope="module")
def single_device(moe_pair, prompts):
    target, drafter = load_target(moe_pair[0]), load_drafter(moe_pair[1])
    config = EngineConfig(max_batch_size=4, max_length=64, steps_per_sync=4)
    return Engine(target, drafter, config).generate(prompts, MAX_NEW), Engine(target, None, config).generate(
        prompts, MAX_NEW)


@pytest.mark.slow
def test_speculative_equals_target_only_equals_transformers(moe_pair, prompts, single_device, reference):
    spec, plain = single_device
    ref = reference.target(moe_pair[0])
    for p, s, t in zip(prompts, spec, plain):
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=MAX_NEW, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
        assert s.output_ids == t.output_ids == want
    assert max(a for s in spec for a in s.acceptance_lengths) > 1  # blocks of several tokens verified


@pytest.mark.slow
@pytest.mark.parametrize("experts_impl", ["auto", "ragged_dot", "capacity"])
def test_expert_and_tensor_parallel_meshes_equal_single_device(experts_impl, moe_pair, prompts, single_device):
    """On (data=2, tensor=4): 2 experts a device, heads split 4 ways; each expert implementation ("auto":
    per-pair products for the decode steps, grouped matmuls for the prompts and verify blocks)."""
    target, drafter = load_target(moe_pair[0]), load_drafter(moe_pair[1])
    if experts_impl == "capacity" and target.config.model_type == "gpt_oss":
        pytest.skip("the capacity implementation runs the same code for both families: Qwen3-MoE covers it")
    config = EngineConfig(max_batch_size=4, max_length=64, steps_per_sync=4, experts_impl=experts_impl,
                          mesh=MeshConfig(fsdp=1, data=2, tensor=4))
    engine = Engine(target, drafter, config)
    moe = next(layer.mlp for layer in engine.target.layers if hasattr(layer.mlp, "experts"))
    weight = moe.experts.gate_up_proj if moe.experts.gate_up_proj is not None else moe.experts.gate_up_proj_blocks
    assert weight[...].sharding.spec[0] == "tensor"  # experts split over the tensor axis
    got = engine.generate(prompts, MAX_NEW)
    for g, w in zip(got, single_device[0]):
        assert g.output_ids == w.output_ids and g.acceptance_lengths == w.acceptance_lengths
