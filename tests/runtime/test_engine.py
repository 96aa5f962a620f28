"""The batched engine against `dflash.model.dflash_generate` and against target-only greedy decoding."""

import dataclasses
import json
import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the oracles; without torch (e.g. a jax-only venv) the module skips

from dflash_jax import ContinuousBatcher, Engine, EngineConfig, SamplingParams, load_drafter, load_target, sharding
from dflash_jax.ops.cache import CACHE_AXES
from dflash_jax.runtime.decoding import DecodeState, commit, greedy_accept, greedy_argmax
from dflash_jax.runtime.engine import window_buckets
from dflash_jax.sharding import MeshConfig, make_mesh, named_sharding
from copycat_fixtures import shallow_copycat_pair
from dflash_jax.tiny import random_drafter, random_target, tiny_drafter_config, tiny_target_config

MAX_NEW = 40


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A pair with varied acceptance lengths (1..B) without training; see write_copycat_pair (over a 2-layer
    target: copycat_fixtures). Seed 2: its rows stop at varied points in the scenarios below (stop ids, rows
    finishing apart), as they must for those tests to exercise what they check."""
    return shallow_copycat_pair(tmp_path_factory.mktemp("copycat"), block_size=8, seed=2)


@pytest.fixture(scope="module")
def models(pair):
    return load_target(pair[0]), load_drafter(pair[1])


@pytest.fixture(scope="module")
def prompts():
    rs = np.random.RandomState(0)
    return [rs.randint(0, 95, n).tolist() for n in (5, 17, 9, 30, 2)]


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    config = EngineConfig(max_batch_size=8, max_length=80, steps_per_sync=4)
    return Engine(target, drafter, config), Engine(target, None, config)


def _assert_same_generations(got, want) -> None:
    """Request by request: the same generated tokens and per-step acceptance lengths."""
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.output_ids == w.output_ids
        assert g.acceptance_lengths == w.acceptance_lengths


def _reference_generate(reference, pair, prompt, max_new, stop):
    ref_target, ref_drafter = reference.target(pair[0]), reference.drafter(pair[1])
    out = reference.model.dflash_generate(ref_drafter, ref_target, torch.tensor([prompt]), max_new_tokens=max_new,
                                          stop_token_ids=stop, return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)


@pytest.fixture(scope="module")
def reference_runs(reference, pair, prompts):
    """dflash_generate (batch size 1) on every prompt, without and with stop tokens."""
    stops = [11, 67]
    return {
        (i, stop is not None): _reference_generate(reference, pair, p, MAX_NEW, stop)
        for i, p in enumerate(prompts) for stop in (None, stops)
    }, stops


@pytest.mark.slow
def test_batch_of_one_equals_dflash_generate(engines, prompts, reference_runs):
    spec, _ = engines
    runs, stops = reference_runs
    all_lengths = []
    for i, p in enumerate(prompts):
        for with_stop in (False, True):
            want_ids, want_acc = runs[(i, with_stop)]
            (got,) = spec.generate([p], MAX_NEW, stop_token_ids=stops if with_stop else None)
            assert got.output_ids == want_ids, (i, with_stop)
            assert got.acceptance_lengths == want_acc, (i, with_stop)
            all_lengths += want_acc
    # The pair really exercises partial and full acceptance.
    assert max(all_lengths) == 8 and 1 in all_lengths and len(set(all_lengths)) >= 4


def test_sliding_drafter_equals_dflash_generate(tmp_path, reference, prompts):
    """A drafter whose first layer slides (window 6, causal: is_causal missing, as the reference reads it):
    batched rows decode as ``dflash_generate`` does each alone, tokens and acceptance lengths. The copycat
    drafter proposes its anchor whatever it attends to, so this checks the config's reading and the
    decode loop end to end; the window's and the causal mask's effect on the drafts are checked against
    the reference in tests/models (``test_sliding_drafter_block_logits_match_dflash``, and the cached
    draft against the forward in ``test_drafter_serving_layout_draft_equals_training_forward``)."""
    target_dir, drafter_dir = shallow_copycat_pair(tmp_path, block_size=8)
    config = json.loads((drafter_dir / "config.json").read_text())
    config.pop("is_causal", None)
    config.update(layer_types=["sliding_attention", "full_attention"], sliding_window=6, use_sliding_window=True)
    (drafter_dir / "config.json").write_text(json.dumps(config))
    drafter = load_drafter(drafter_dir)
    assert drafter.config.layer_window(0) == 6 and drafter.config.layer_causal(0)
    spec = Engine(load_target(target_dir), drafter, EngineConfig(max_batch_size=4, max_length=80, steps_per_sync=4))
    chosen = prompts[:3]
    got = spec.generate(chosen, MAX_NEW)
    lengths = []
    for prompt, row in zip(chosen, got):
        want_ids, want_acc = _reference_generate(reference, (target_dir, drafter_dir), prompt, MAX_NEW, None)
        assert (row.output_ids, row.acceptance_lengths) == (want_ids, want_acc)
        lengths += want_acc
    assert max(lengths) > 1  # drafts are accepted, not only bonus tokens


@pytest.mark.slow
def test_batched_rows_equal_rows_alone_and_reference(engines, prompts, reference_runs):
    spec, _ = engines
    runs, stops = reference_runs
    batch = spec.generate(prompts, MAX_NEW, stop_token_ids=stops)
    for i, got in enumerate(batch):
        want_ids, want_acc = runs[(i, True)]
        assert got.output_ids == want_ids
        assert got.acceptance_lengths == want_acc
        assert got.finish_reason == ("stop" if want_ids[-1] in stops else "length")
        assert got.tau == pytest.approx(np.mean(want_acc))


def test_speculative_equals_target_only_greedy(engines, prompts):
    spec, plain = engines
    stops = [11, 67]
    max_new = [40, 7, 23, 1, 33]  # per-row limits
    got = spec.generate(prompts, max_new, stop_token_ids=stops)
    want = plain.generate(prompts, max_new, stop_token_ids=stops)
    for g, w, m in zip(got, want, max_new):
        assert g.output_ids == w.output_ids
        assert len(g.output_ids) <= m
        assert w.acceptance_lengths == []
        assert sum(g.acceptance_lengths) + 1 == len(g.output_ids)
        # The prefill commits the first token, each decode step the next acc + 1 (target-only: one).
        assert g.num_steps == len(g.acceptance_lengths) and w.num_steps == len(w.output_ids) - 1
        assert w.tau == 1.0


@pytest.mark.slow
def test_target_only_equals_transformers_greedy(engines, prompts, pair, reference):
    _, plain = engines
    ref = reference.target(pair[0])
    for p in prompts[:2]:
        with torch.no_grad():
            want = ref.generate(torch.tensor([p]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                pad_token_id=0)[0, len(p):].tolist()
        (got,) = plain.generate([p], 20)
        assert got.output_ids == want


@pytest.mark.slow
def test_streaming_callback_yields_exactly_the_output(engines, prompts):
    spec, _ = engines
    streamed = {i: [] for i in range(len(prompts))}
    results = spec.generate(prompts, MAX_NEW, on_tokens=lambda i, ids: streamed[i].extend(ids))
    for i, r in enumerate(results):
        assert streamed[i] == r.output_ids


def test_greedy_accept_counts_leading_matches_within_the_valid_block():
    draft = jnp.array([[5, 6, 7], [5, 9, 7], [1, 2, 3], [5, 6, 7]])
    posterior = jnp.array([[5, 6, 7, 8], [5, 6, 7, 8], [0, 2, 3, 4], [5, 6, 7, 8]])
    valid = jnp.array([4, 4, 4, 3])
    np.testing.assert_array_equal(greedy_accept(draft, posterior, valid), [3, 1, 0, 2])


@pytest.mark.slow
def test_commit_writes_accepted_tokens_and_cuts_at_stops_and_max_length():
    """Four rows of one step, block 4, each drafting [anchor 12, 20, 21, 22] against the target's
    [20, 21, 30, 31] (two drafts accepted, bonus 30): a plain row, a row whose second new token is
    one of its stop ids, a row cut by its max_length, and a done row, which must not change."""
    tokens = np.full((4, 10), 7, np.int32)
    tokens[:, :3] = [10, 11, 12]
    accepted = np.zeros((4, 6), np.int32)
    accepted[3, :3] = [1, 2, 1]
    state = DecodeState(
        tokens=jnp.asarray(tokens), starts=jnp.full((4,), 2, jnp.int32), max_lens=jnp.array([10, 10, 5, 10]),
        done=jnp.array([False, False, False, True]), num_steps=jnp.array([1, 1, 1, 3]),
        accepted=jnp.asarray(accepted), stop_ids=jnp.array([[-1, -1], [-1, 21], [-1, -1], [-1, -1]]),
        target_cache=None, draft_cache=None,
    )
    block_ids = jnp.tile(jnp.array([[12, 20, 21, 22]]), (4, 1))
    posterior = jnp.tile(jnp.array([[20, 21, 30, 31]]), (4, 1))
    acc = greedy_accept(block_ids[:, 1:], posterior, jnp.full((4,), 4))
    np.testing.assert_array_equal(acc, [2, 2, 2, 2])
    new, produced = commit(state, block_ids, posterior, acc)
    np.testing.assert_array_equal(produced, [3, 2, 2, 0])
    np.testing.assert_array_equal(new.starts, [5, 4, 4, 2])
    np.testing.assert_array_equal(new.done, [False, True, True, True])
    np.testing.assert_array_equal(new.num_steps, [2, 2, 2, 3])
    np.testing.assert_array_equal(new.tokens[0], [10, 11, 12, 20, 21, 30, 7, 7, 7, 7])
    for row in (1, 2):  # the committed tokens; later positions are never read
        np.testing.assert_array_equal(new.tokens[row, :5], [10, 11, 12, 20, 21])
    np.testing.assert_array_equal(new.tokens[3], tokens[3])
    np.testing.assert_array_equal(new.accepted, [[0, 3, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0], [0, 2, 0, 0, 0, 0],
                                                 [1, 2, 1, 0, 0, 0]])


def test_bad_requests_are_clear_errors(engines):
    spec, _ = engines
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        spec.generate([[1], []], 4)
    with pytest.raises(ValueError, match="max_length is 80"):
        spec.generate([[1] * 90], 4)
    with pytest.raises(ValueError, match="outside"):
        spec.generate([[1, 500]], 4)


def test_generate_refuses_bad_arguments_naming_them(models):
    """``dflash_jax.generate``'s bad arguments are errors that name them, raised before anything compiles.
    Token ids and max_new_tokens went through ``int()`` (1.5 ran as 1), a max_new_tokens below 1 sized the
    engine before it was checked ("max_length must be >= 2"), a flat list failed on ``len(1)``."""
    import dflash_jax

    target, drafter = models
    for kwargs, error, message in (
        (dict(prompts=[[1.5, 2]]), ValueError, r"prompt 0 must be integers \(token ids\), got \[1.5, 2\]"),
        (dict(prompts=["hello"]), ValueError, "prompt 0 must be integers"),
        (dict(prompts=[1, 2, 3]), TypeError, "prompts must be a list of token-id lists"),
        (dict(max_new_tokens=0), ValueError, "max_new_tokens for prompt 0 must be >= 1, got 0"),
        (dict(max_new_tokens=-5), ValueError, "max_new_tokens for prompt 0 must be >= 1, got -5"),
        (dict(max_new_tokens=4.5), ValueError, "max_new_tokens for prompt 0 must be an integer, got 4.5"),
        (dict(stop_token_ids=0), ValueError, "stop_token_ids must be integers"),  # `0 or ()`: it was ignored
        (dict(prompts=[[1, True, 3]]), ValueError, "prompt 0 must be integers .token ids., not booleans"),
        (dict(stop_token_ids=[-1]), ValueError, r"stop_token_ids for prompt 0 holds ids outside \[0, "),
        (dict(prompts=[[]], max_new_tokens=1), ValueError, "prompt 0 is empty"),
    ):
        args = dict(prompts=[[1, 2, 3]], max_new_tokens=4) | kwargs
        with pytest.raises(error, match=message):
            dflash_jax.generate(target, drafter, **args)


def test_prompt_beyond_the_largest_bucket_is_refused_at_submission(models):
    """Refused when submitted (no compile here): in the prefill it failed every prompt prefilled with it,
    and ``Engine.generate`` raised only after every other prompt had run."""
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(max_batch_size=2, max_length=80, prompt_buckets=(8, 16)))
    batcher = ContinuousBatcher(engine)
    batcher.submit([1] * 16, 4)
    with pytest.raises(ValueError, match="the prompt has 17 tokens, more than the largest prompt bucket, 16"):
        batcher.submit([1] * 17, 4)
    assert batcher.waiting == 1


@pytest.mark.parametrize("mesh,decode_loop", [(dict(data=1, tensor=8), "auto"), (dict(data=2, tensor=4), "auto"),
                                              (dict(data=2, tensor=4), "fixed")])
@pytest.mark.slow
def test_sharded_engine_equals_single_device(mesh, decode_loop, pair, prompts, engines):
    """On 8 devices, with the decode loop that stops once every row is done ("auto" off GPUs) and
    with the fixed step count of GPU meshes: the one-device engine's tokens and acceptance lengths."""
    spec, _ = engines
    want = spec.generate(prompts[:4], 24)
    target, drafter = load_target(pair[0]), load_drafter(pair[1])
    config = EngineConfig(max_batch_size=4, max_length=80, steps_per_sync=4, decode_loop=decode_loop,
                          mesh=MeshConfig(fsdp=1, **mesh))
    sharded = Engine(target, drafter, config)
    assert len(jax.devices()) == 8 and sharded.mesh.shape["tensor"] == mesh["tensor"]
    assert sharded.fixed_loop == (decode_loop == "fixed")
    got = sharded.generate(prompts[:4], 24)
    _assert_same_generations(got, want)


@pytest.mark.slow
def test_fixed_decode_loop_has_a_known_trip_count(models):
    """``decode_loop="fixed"`` compiles the steps as a loop of known trip count (which XLA:GPU runs
    without reading a condition on the host) over the whole cache; "until_done" as a loop that
    stops early, over windows of the cache. Both run exactly the steps they are asked for while rows
    are live, and a fixed call on finished rows changes nothing the host reads."""
    target, drafter = models
    engines = {loop: Engine(target, drafter, EngineConfig(max_batch_size=1, max_length=80, steps_per_sync=4,
                                                           attention_impl="xla", decode_loop=loop))
               for loop in ("until_done", "fixed")}
    for loop, engine in engines.items():
        state = _running_state(engine, [3, 1, 4, 1, 5], 60)
        loops = [line for line in engine.decode_hlo(state, 3).splitlines() if " while(" in line]
        assert len(loops) == 1 and ('"known_trip_count":{"n":"3"}' in loops[0]) == (loop == "fixed")
        assert engine.windows == ((engine.capacity,) if loop == "fixed" else window_buckets(engine.capacity))
        state, snap = engine.decode(state, n_steps=3)
        assert np.asarray(snap.num_steps).tolist() == [3]
    fixed = engines["fixed"]
    state = _running_state(fixed, [3, 1, 4], 2)
    state, first = fixed.decode(state, n_steps=3)
    assert bool(np.asarray(first.done)[0]) and np.asarray(first.num_steps)[0] < 3
    _, again = fixed.decode(state, n_steps=3)
    for a, b in zip(jax.tree.leaves(first), jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.slow
def test_sharded_pallas_engine_equals_single_device(pair, prompts, engines, monkeypatch):
    """The Pallas kernels on a 4 x 2 (data x tensor) mesh, each device on its own rows and KV heads
    (``sharding.shard_kernel``; interpret mode), give the tokens of the one-device XLA engine; the
    kernels are traced inside ``shard_map``, not left to XLA's propagation."""
    import kernels_pallas.cached_attention

    spec, _ = engines
    want = spec.generate(prompts[:4], 16)
    target, drafter = load_target(pair[0]), load_drafter(pair[1])
    config = EngineConfig(max_batch_size=4, max_length=80, steps_per_sync=4, attention_impl="pallas",
                          mesh=MeshConfig(data=4, fsdp=1, tensor=2))
    sharded = Engine(target, drafter, config)
    assert target.config.num_kv_heads % 2 == 0  # KV heads really split across the tensor axis
    per_device = []
    kernel = kernels_pallas.cached_attention.cached_block_attention

    def spy(qkv, *args, **kwargs):
        per_device.append(qkv.shape)
        return kernel(qkv, *args, **kwargs)

    monkeypatch.setattr(kernels_pallas.cached_attention, "cached_block_attention", spy)
    got = sharded.generate(prompts[:4], 16)
    _assert_same_generations(got, want)
    # Each kernel call is traced twice: for its global output shapes, then per device in shard_map
    # on one row of four and half of the KV heads.
    kv = target.config.num_kv_heads
    local = [s for s in per_device if s[0] == 1 and s[2] == kv // 2]
    assert local and len(local) * 2 == len(per_device)


@pytest.mark.slow
def test_pallas_engine_with_more_tensor_devices_than_kv_heads():
    """8 query heads over 2 KV heads on a 1 x 8 mesh: the KV heads (and the caches) stay whole on
    every device while the query heads could split eight ways; the cached-attention kernel's output
    must keep its [kv_heads, groups] layout through ``shard_kernel`` (it was regrouped by query head,
    so its replicated KV axis came back eight times over). Same tokens as one device with XLA."""
    tcfg = tiny_target_config(num_heads=8, num_kv_heads=2, head_dim=8, num_layers=2)
    dcfg = tiny_drafter_config(tcfg, num_layers=2, block_size=8)
    target, drafter = random_target(tcfg, std=0.5), random_drafter(dcfg, std=0.5)
    prompts = [[3, 1, 4, 1, 5], [9, 2, 6, 5, 3, 5, 8, 9, 7]]
    config = EngineConfig(max_batch_size=2, max_length=48, steps_per_sync=4, attention_impl="xla")
    want = Engine(target, drafter, config).generate(prompts, 12)
    sharded = Engine(target, drafter, dataclasses.replace(config, attention_impl="pallas",
                                                          mesh=MeshConfig(data=1, fsdp=1, tensor=8)))
    assert sharded.mesh.shape["tensor"] == 8
    _assert_same_generations(sharded.generate(prompts, 12), want)


@pytest.mark.slow
def test_engine_with_tpu_flash_prefill_equals_xla(models, prompts, engines, tpu_flash_interpreted):
    """The engine with its prompts' attention by JAX's Pallas TPU flash attention (TPU interpret mode
    on the CPU; prompts of 2-30 tokens in the kernel's 128-slot tiles) gives the XLA engine's tokens
    and acceptance lengths."""
    spec, _ = engines
    target, drafter = models
    engine = Engine(target, drafter, EngineConfig(max_batch_size=2, max_length=80, steps_per_sync=4,
                                                  attention_impl="pallas"))
    got = engine.generate(prompts[:3], 12)
    assert tpu_flash_interpreted  # every target layer's prompt attention
    _assert_same_generations(got, spec.generate(prompts[:3], 12))


@pytest.mark.slow
def test_pallas_attention_engine_equals_xla(models, prompts, engines):
    """The engine with the Pallas kernels (interpret mode on the CPU) gives the same tokens."""
    spec, _ = engines
    target, drafter = models
    pallas = Engine(target, drafter, EngineConfig(max_batch_size=2, max_length=80, steps_per_sync=4,
                                                  attention_impl="pallas"))
    got = pallas.generate(prompts[:2], 12)
    want = spec.generate(prompts[:2], 12)
    _assert_same_generations(got, want)


@pytest.mark.slow
def test_single_row_partials_engine_equals_xla(models, prompts, engines, monkeypatch):
    """A decode token's QKV and output projections with their split-K written out, as on one GPU
    (``ops.linear.single_row_partials``; the GPU rule switched on here): the QKV partials summed by the
    cached-attention kernel (interpret mode), the output projection's by XLA. The same tokens and
    acceptance lengths as the plain engine, speculative and target-only; only single rows take it."""
    from dflash_jax.models import layers
    from dflash_jax.ops import linear
    from dflash_jax.ops.config import OpsConfig

    from dflash_jax.runtime import engine as engine_module

    monkeypatch.setattr(linear, "_strength_reduces_single_rows", lambda: True)
    monkeypatch.setattr(engine_module, "weight_major_gemms", lambda: False)  # a GPU's layout: weights [in, out]
    taken = []
    partials = linear.single_row_partials

    def spy(x, w, parts, in_dims=1):
        out = partials(x, w, parts, in_dims)
        taken.append(None if out is None else (parts, out.shape))
        return out

    monkeypatch.setattr(layers, "single_row_partials", spy)  # the QKV's, taken in the model
    monkeypatch.setattr(linear, "single_row_partials", spy)  # the output projection's, in ``ops.linear``
    target, drafter = models
    config = EngineConfig(max_batch_size=2, max_length=80, steps_per_sync=4, attention_impl="pallas")
    for i, engine in enumerate((Engine(target, drafter, config), Engine(target, None, config))):
        got = engine.generate(prompts[:1], 12)
        _assert_same_generations(got, engines[i].generate(prompts[:1], 12))
    hidden, kv_heads, head_dim = target.config.hidden_size, target.config.num_kv_heads, target.config.head_dim
    groups = target.config.num_heads // kv_heads
    ops = OpsConfig()
    assert {t for t in taken if t is not None} == {(ops.qkv_partials, (8, 2, kv_heads, groups + 2, head_dim)),
                                                   (ops.output_partials, (8, 2, hidden))}
    taken.clear()  # two rows (and a verify block's, a prefill's) take the plain dots
    Engine(target, None, config).generate(prompts[:2], 4)
    assert taken and all(t is None for t in taken)


def test_input_last_weights_give_the_same_generations(models, prompts, engines, monkeypatch):
    """On a CPU the engine stores its copies' weights input-last (``serving_params.store_input_last``, for
    ``ops.linear.dot_input_last``): the same tokens and acceptance lengths as the layout a GPU serves
    (weights ``[in, out]``), speculative and target-only; ``derive`` with another drafter stores it alike;
    the user's modules keep their checkpoint layout."""
    from flax import nnx

    from dflash_jax.ops.linear import INPUT_LAST
    from dflash_jax.runtime import engine as engine_module

    def stores_input_last(module) -> bool:
        return any(isinstance(w, nnx.Param) and w.get_metadata().get(INPUT_LAST) for _, w in nnx.iter_graph(module))

    target, drafter = models
    spec, plain = engines
    assert stores_input_last(spec.target) and stores_input_last(spec.drafter)
    assert stores_input_last(plain.derive(drafter=drafter).drafter)
    assert not stores_input_last(target) and not stores_input_last(drafter)
    assert spec.target.lm_head.get_metadata()[INPUT_LAST] and target.lm_head.shape == spec.target.lm_head.shape[::-1]
    monkeypatch.setattr(engine_module, "weight_major_gemms", lambda: False)
    config = EngineConfig(max_batch_size=8, max_length=80, steps_per_sync=4)
    for mine, theirs in zip(engines, (Engine(target, drafter, config), Engine(target, None, config))):
        assert not stores_input_last(theirs.target)
        _assert_same_generations(mine.generate(prompts, 12), theirs.generate(prompts, 12))


def _bfloat16_valued(module):
    """A copy of ``module`` whose float32 parameters hold bfloat16 values (a bfloat16 checkpoint loaded in float32)."""
    from flax import nnx

    copy = nnx.clone(module)
    for _, var in nnx.to_flat_state(nnx.state(copy, nnx.Param)):
        value = var.get_value()
        if value.dtype == jnp.float32:
            var.set_value(value.astype(jnp.bfloat16).astype(jnp.float32))
    return copy


def test_bfloat16_weights_give_the_same_generations(models, prompts, monkeypatch):
    """On a CPU, a pair of bfloat16 values served with bfloat16 weights (``EngineConfig.cpu_bfloat16_weights``:
    float32 rows times them as three exact bfloat16 products) generates the same tokens and acceptance lengths
    as served in float32, speculative and target-only; a derived engine keeps the setting, and one asking for
    the other is refused. ``None`` follows the CPU's bfloat16 matrix units."""
    from dflash_jax.runtime import engine as engine_module

    target, drafter = (_bfloat16_valued(m) for m in models)
    on = EngineConfig(max_batch_size=8, max_length=80, steps_per_sync=4, cpu_bfloat16_weights=True)
    off = dataclasses.replace(on, cpu_bfloat16_weights=False)
    spec_on, spec_off = Engine(target, drafter, on), Engine(target, drafter, off)
    assert spec_on.target.layers[0].mlp.down_proj.dtype == jnp.bfloat16 and spec_on.drafter.fc.dtype == jnp.bfloat16
    assert spec_off.target.layers[0].mlp.down_proj.dtype == jnp.float32 and spec_on.drafter.dtype == jnp.float32
    assert target.layers[0].mlp.down_proj.dtype == jnp.float32  # the user's modules as they were
    for mine, theirs in ((spec_on, spec_off), (spec_on.derive(drafter=None), spec_off.derive(drafter=None))):
        _assert_same_generations(mine.generate(prompts, 12), theirs.generate(prompts, 12))
    with pytest.raises(ValueError, match="cpu_bfloat16_weights"):
        spec_on.derive(off)
    for units in (True, False):
        monkeypatch.setattr(engine_module, "bfloat16_matrix_units", lambda v=units: v)
        assert engine_module._serving_layout(EngineConfig(), None)["bfloat16_weights"] is units
        assert engine_module._serving_layout(on, None)["bfloat16_weights"] is True
        assert engine_module._serving_layout(off, None)["bfloat16_weights"] is False


@pytest.mark.slow
def test_warmup_compiles_everything_serving_runs(caplog):
    """After ``warmup``, requests of every prompt bucket, admitted alone, two at once (two choices of
    one prompt too) and into running rows, the running state moving between one row and two, one
    request cancelled and one needing the whole cache, compile nothing: a shape compiled while serving
    stalls every running request for its compile. Target-only: a drafter adds no shapes, only compile time. The warm-up
    logs what it compiles as it goes (minutes of silence otherwise, for a large model). A random target of two
    layers: the shapes, not the depth, decide what compiles (every layer more is compile time of every program)."""
    target = random_target(tiny_target_config(num_layers=2))
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=100, steps_per_sync=4))
    assert engine.windows == (64, 128)  # capacity 100 + 1, rounded up to whole tiles
    assert engine.prompt_buckets() == [(16, 1), (32, 17), (64, 33), (128, 65)]
    with caplog.at_level(logging.INFO, logger="dflash_jax.runtime.engine"):
        assert engine.warmup() > 0
    progress = [r.getMessage() for r in caplog.records if r.name == "dflash_jax.runtime.engine"]
    assert len(progress) == 3
    assert "decode for running states of [1, 2] rows at 2 attention windows" in progress[0]
    assert ("16 prefill shapes (a lone request's in 4 prompt buckets; 2 prompt counts x 4 prompt buckets, and 4 of "
            "one prompt's n choices, for the batch)") in progress[1]
    compiles: list[str] = []  # XLA compilations while the requests below run: none

    def listen(event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and listening:
            compiles.append(event)

    listening = True
    jax.monitoring.register_event_duration_secs_listener(listen)
    rs = np.random.RandomState(4)
    prompt = lambda n: rs.randint(0, 95, n).tolist()  # noqa: E731
    batcher = ContinuousBatcher(engine)
    lone = batcher.submit(prompt(3), 90)  # 1 row, bucket 16; grows into the whole cache
    batcher.step()
    joining = [batcher.submit(prompt(n), 6) for n in (40, 70, 20)]  # into the running batch, one by one
    batcher.step()
    joining[0].cancel()  # running: its row is released
    joining[2].cancel()  # still waiting
    batcher.run()
    pair = [batcher.submit(prompt(n), 6) for n in (30, 99)]  # a prefill of 2 rows, the last bucket
    batcher.run()
    choices = [batcher.submit(p, 6) for p in [prompt(50)] * 2]  # one prompt's 2 choices: one row's pass, copied
    batcher.run()
    listening = False
    assert compiles == []
    assert joining[0].admitted is not None and joining[0].result is None and joining[2].admitted is None
    assert len(lone.result.output_ids) == 90 and all(g.result is not None for g in joining[1:2] + pair + choices)


def test_greedy_argmax_is_argmax_with_ties_nans_and_infinities():
    rs = np.random.RandomState(1)
    for vocab in (4096, 96, 100, 17):
        logits = rs.randint(-2, 3, (40, vocab)).astype(np.float32)  # many ties for the maximum
        logits[0, 5] = logits[0, vocab - 1] = np.nan
        logits[1, :] = -np.inf
        logits[2, vocab // 2] = np.inf
        logits[3, :] = 0.0
        got = np.asarray(jax.jit(greedy_argmax)(jnp.asarray(logits)))
        want = np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1))
        np.testing.assert_array_equal(got, want)
        assert got.dtype == np.int32 and got[0] == 5 and got[3] == 0


def test_greedy_argmax_across_vocab_shards_is_argmax():
    """On a mesh that splits the vocabulary four ways, the per-slice argmax and the exchange of one
    (value, index) pair per row give ``jnp.argmax``: ties across slices go to the first, a NaN in a
    later slice still wins, rows split over ``data`` stay independent."""
    rs = np.random.RandomState(2)
    logits = rs.randint(-2, 3, (4, 3, 96)).astype(np.float32)
    logits[0, 0, :] = 0.0
    logits[0, 1, [30, 70]] = 9.0  # a tie between the second and the third slice
    logits[1, 0, 80] = np.nan
    logits[1, 1, [5, 60]] = np.nan
    logits[2, 2, :] = -np.inf
    mesh = make_mesh(MeshConfig(data=2, fsdp=1, tensor=4))
    axes = ("batch", "length", "vocab")
    x = jax.device_put(jnp.asarray(logits), named_sharding(axes, logits.shape, mesh))
    with sharding.kernel_mesh(mesh):
        assert sharding.kernel_mesh_axes(axes, logits.shape, -1) == ("tensor",)
        got = np.asarray(jax.jit(greedy_argmax)(x))
    np.testing.assert_array_equal(got, np.asarray(jnp.argmax(jnp.asarray(logits), axis=-1)))
    assert got[0, 0] == 0 and got[0, 1] == 30 and got[1, 0] == 80 and got[1, 1] == 5


def test_window_buckets_are_powers_of_two_then_the_capacity():
    assert window_buckets(88) == (88,)  # a 64-position window would save too little to pay for a variant
    assert window_buckets(246) == (64, 246)
    assert window_buckets(2064) == (64, 128, 256, 512, 1024, 2064)


@pytest.fixture(scope="module")
def long_engines(models):
    """Engines whose capacity (640: 512 + 8 rounded up to whole tiles) is far beyond what the prompts
    reach: decode calls get windows."""
    target, drafter = models
    config = EngineConfig(max_batch_size=8, max_length=512, steps_per_sync=4)
    return Engine(target, drafter, config), Engine(target, None, config)


def _record_windows(engine, monkeypatch) -> list[int]:
    used = []
    decode = engine.decode

    def spy(state, n_steps=None, *, window=None):
        used.append(engine._window(window))
        return decode(state, n_steps, window=window)

    monkeypatch.setattr(engine, "decode", spy)
    return used


@pytest.mark.slow
def test_windowed_decode_equals_dflash_generate_and_greedy(long_engines, prompts, reference_runs, monkeypatch):
    spec, plain = long_engines
    assert spec.windows == (64, 128, 256, 640)
    runs, stops = reference_runs
    spec_windows, plain_windows = _record_windows(spec, monkeypatch), _record_windows(plain, monkeypatch)
    for i, p in enumerate(prompts):
        want_ids, want_acc = runs[(i, True)]
        (got,) = spec.generate([p], MAX_NEW, stop_token_ids=stops)
        assert got.output_ids == want_ids and got.acceptance_lengths == want_acc
        (alone,) = plain.generate([p], MAX_NEW, stop_token_ids=stops)
        assert alone.output_ids == want_ids
    batch = spec.generate(prompts, MAX_NEW, stop_token_ids=stops)
    for i, got in enumerate(batch):
        assert (got.output_ids, got.acceptance_lengths) == runs[(i, True)]
    # The rows never needed the whole capacity: every call read a prefix of the caches, growing
    # with the rows (plain rows advance one position per step and stay within 64 here).
    assert set(spec_windows) == {64, 128} and set(plain_windows) == {64}


@pytest.mark.slow
def test_adaptive_steps_per_call_keep_the_tokens(long_engines, prompts, reference_runs, monkeypatch):
    """Calls whose steps grow (max_steps_per_sync, as when the device outruns the host; forced here)
    still read windows that cover their rows: the same tokens and acceptance lengths as the
    reference, in calls of up to 16 steps (the host's waits on this CPU halve them at times)."""
    import dataclasses

    import dflash_jax.runtime.batcher as batcher

    spec, _ = long_engines
    runs, stops = reference_runs
    monkeypatch.setattr(spec, "config", dataclasses.replace(spec.config, max_steps_per_sync=16))
    monkeypatch.setattr(batcher, "_is_ready", lambda tree: True)
    steps = []
    decode = spec.decode

    def spy(state, n_steps=None, *, window=None):
        steps.append(n_steps)
        return decode(state, n_steps, window=window)

    monkeypatch.setattr(spec, "decode", spy)
    batch = spec.generate(prompts, MAX_NEW, stop_token_ids=stops)
    for i, got in enumerate(batch):
        assert (got.output_ids, got.acceptance_lengths) == runs[(i, True)]
    assert steps[:3] == [4, 8, 16] and max(steps) == 16


def _running_state(engine, prompt, max_new):
    """A one-row running state holding ``prompt`` (no stop ids), admitted as the batcher does."""
    fresh, _ = engine.prefill([prompt], [max_new], [()])
    return engine.admit(engine.empty_state(1), fresh, [0])


@pytest.mark.slow
def test_decode_stops_at_the_edge_of_its_window(long_engines, prompts, reference_runs):
    """A call whose window is too small for the rows stops before outgrowing it; a call with a larger
    window continues to the same tokens as uninterrupted generation."""
    spec, _ = long_engines
    runs, _ = reference_runs
    p = prompts[3]  # 30 tokens: a block of 8 at start >= 57 no longer fits a 64-position window
    state = _running_state(spec, p, MAX_NEW)
    state, _ = spec.decode(state, n_steps=100, window=64)
    start = int(np.asarray(state.starts)[0])
    assert not bool(np.asarray(state.done)[0])
    assert start + spec.block_size > 64 >= start  # stopped at the edge, not at the step limit
    state, _ = spec.decode(state, n_steps=100, window=128)
    end = min(int(np.asarray(state.starts)[0]) + 1, len(p) + MAX_NEW)
    assert np.asarray(state.tokens)[0, len(p):end].tolist() == runs[(3, False)][0]
    assert np.asarray(state.accepted)[0, : int(np.asarray(state.num_steps)[0])].tolist() == runs[(3, False)][1]


@pytest.mark.slow
def test_decode_loop_does_not_copy_the_caches(long_engines):
    """The compiled decode step updates the KV caches in place (on the CPU, XLA's default copy
    insertion would copy every target-cache buffer twice per step)."""
    for engine in long_engines:
        state = _running_state(engine, [1, 2, 3], 4)
        for window in (64, engine.capacity):
            hlo = engine.decode_hlo(state, 4, window=window)
            tc = engine.target.config
            cache_shape = f"f32[1,{engine.capacity},{tc.num_kv_heads},{tc.head_dim}]"
            copies = [line for line in hlo.splitlines() if f"= {cache_shape}" in line and " copy(" in line]
            assert copies == [], copies[:3]


@pytest.mark.parametrize("sampling", [None, SamplingParams(temperature=0.8, top_p=0.9, seed=5, logprobs=2)])
def test_a_lone_prefill_is_the_admission_of_its_rows_into_an_empty_state(engines, prompts, sampling):
    """``prefill(alone=True)``, one program, gives the running state that ``admit`` of the prefilled rows
    into ``empty_state(1)`` gives, every array bit for bit (a greedy row's and a sampled row's first draw)."""
    engine, _ = engines
    args = ([prompts[1]], [12], [[3, 7]], None if sampling is None else [sampling])
    rows, first = engine.prefill(*args)
    want = engine.admit(engine.empty_state(1), rows, [0])
    got, got_first = engine.prefill(*args, alone=True)
    np.testing.assert_array_equal(np.asarray(got_first), np.asarray(first))
    assert jax.tree.structure(got) == jax.tree.structure(want)
    for path, a, b in zip(jax.tree_util.tree_leaves_with_path(want), jax.tree.leaves(want), jax.tree.leaves(got)):
        assert a.shape == b.shape and a.dtype == b.dtype, path[0]
        np.testing.assert_array_equal(np.asarray(b), np.asarray(a), err_msg=jax.tree_util.keystr(path[0]))
    with pytest.raises(ValueError, match="one prompt"):
        engine.prefill([prompts[0], prompts[1]], [4, 4], [[], []], alone=True)


def test_one_shot_graphs_follow_the_target_size_unless_configured(models, monkeypatch):
    """The one-shot programs (prefill, admission, ...) run as CUDA graphs for a target below
    ONE_SHOT_GRAPH_MAX_PARAMS and are launched kernel by kernel above it; an explicit setting wins."""
    from dflash_jax.runtime import engine as engine_module

    target, _ = models
    config = EngineConfig(max_batch_size=1, max_length=32)
    assert Engine(target, None, config).one_shot_graphs is True
    monkeypatch.setattr(engine_module, "ONE_SHOT_GRAPH_MAX_PARAMS", 10)
    assert Engine(target, None, config).one_shot_graphs is False
    assert Engine(target, None, dataclasses.replace(config, one_shot_graphs=True)).one_shot_graphs is True
    monkeypatch.undo()
    assert Engine(target, None, dataclasses.replace(config, one_shot_graphs=False)).one_shot_graphs is False
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert engine_module._one_shot_compiler_options(True) is None  # XLA's default command buffers
    assert engine_module._one_shot_compiler_options(False) == {"xla_gpu_enable_command_buffer": ""}


@pytest.mark.slow
def test_engine_serves_fused_target_at_the_configured_precision(qwen3_pair):
    """The engine runs copies of the target and the drafter in their serving layouts, leaving the
    modules passed in unchanged (the same parameter tree, the same values), so that engines of other
    settings can be built from the same loaded modules; it refuses an engine's own (served) module;
    it traces float32 models at ``highest`` matmul precision ("auto")."""
    from flax import nnx

    target_dir, drafter_dir = qwen3_pair
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)

    def snapshot(module):
        return {path: np.asarray(v.get_value()) for path, v in nnx.to_flat_state(nnx.state(module))}

    before = snapshot(target), snapshot(drafter)
    engine = Engine(target, drafter, EngineConfig(max_batch_size=1, max_length=64))
    for module, was in zip((target, drafter), before):
        now = snapshot(module)
        assert now.keys() == was.keys()
        for path, value in now.items():
            np.testing.assert_array_equal(value, was[path], err_msg=str(path))
    assert target.layers[0].self_attn.qkv_proj is None and target.layers[0].self_attn.q_proj is not None
    assert drafter.context_kv_proj is None and drafter.layers[0].mlp.gate_up_proj is None
    served = engine.target.layers[0]
    assert served.self_attn.qkv_proj is not None and served.mlp.gate_up_proj is not None and served.norms_folded
    assert engine.drafter.layers[0].self_attn.qkv_proj is not None and engine.drafter.context_kv_proj is not None
    with pytest.raises(ValueError, match="serving layout"):
        Engine(engine.target, None, EngineConfig(max_batch_size=1, max_length=64))
    other = Engine(target, drafter, EngineConfig(max_batch_size=2, max_length=48, steps_per_sync=2))
    prompt = [[3, 1, 4, 1, 5]]
    assert other.generate(prompt, 6)[0].output_ids == engine.generate(prompt, 6)[0].output_ids
    assert engine._matmul_precision == "highest"
    hlo = engine._prefill.lower(engine._target_state, engine._drafter_state,
                                *engine._prefill_inputs([[0] * 16], [8], [()])).as_text()
    assert "HIGHEST" in hlo
    again = Engine(target, None, EngineConfig(max_batch_size=1, max_length=64, matmul_precision="default"))
    assert again._matmul_precision == "default"
    with pytest.raises(ValueError, match="matmul_precision"):
        EngineConfig(matmul_precision="fast").validate()


# -- continuous batching -------------------------------------------------------------------------

# Twelve requests for eight row slots: mixed prompt lengths, stop ids and limits per request, and the
# host sync before which each is submitted (request 0 starts alone; at sync 3 seven arrive while at
# least two rows are taken, so one waits for a row; the last ones find the batch draining). Request 6
# is cancelled at sync 4, while its first decode call is in flight.
STAGGERED_LENGTHS = (5, 17, 9, 30, 2, 12, 21, 7, 3, 26, 14, 8)
STAGGERED_STOPS = [(), (11, 67), (67,), (11,), (5, 11, 67, 80)] * 3
STAGGERED_MAX_NEW = (40, 7, 23, 1, 33, 12, 40, 5, 29, 17, 40, 3)
STAGGERED_AT = (0, 2, 2, 3, 3, 3, 3, 3, 3, 3, 6, 9)
CANCELLED, CANCELLED_AT = 6, 4


def _run_staggered(engine, prompts, monkeypatch) -> tuple[list, dict[int, list[int]], list, int]:
    """Submits the staggered requests to one ``ContinuousBatcher`` at their host syncs; returns the
    generations, the tokens each streamed, every ``resize`` as (old rows, kept rows, new rows), and
    the most requests left waiting for a row after a sync."""
    resizes = []
    resize = engine.resize

    def spy(state, keep, *, rows):
        resizes.append((state.starts.shape[0], list(keep), rows))
        return resize(state, keep, rows=rows)

    monkeypatch.setattr(engine, "resize", spy)
    batcher = ContinuousBatcher(engine)
    streamed: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    generations: list = [None] * len(prompts)
    sync = waited = 0
    while sync <= max(STAGGERED_AT) or not batcher.idle:
        for i, at in enumerate(STAGGERED_AT):
            if at == sync:
                generations[i] = batcher.submit(prompts[i], STAGGERED_MAX_NEW[i], STAGGERED_STOPS[i],
                                                on_tokens=streamed[i].extend)
        if sync == CANCELLED_AT:
            generations[CANCELLED].cancel()
        batcher.step()
        waited = max(waited, batcher.waiting)
        sync += 1
    return generations, streamed, resizes, waited


@pytest.mark.parametrize("speculative", [True, False])
@pytest.mark.slow
def test_staggered_requests_equal_each_request_alone(speculative, engines, monkeypatch):
    """Requests admitted at different host syncs into rows that others are decoding in (more requests
    than rows, a cancelled one among them) get exactly the tokens and acceptance lengths they get
    alone; the running batch moves between one row and all eight with live rows in it."""
    engine = engines[0] if speculative else engines[1]
    rs = np.random.RandomState(2)
    prompts = [rs.randint(0, 95, n).tolist() for n in STAGGERED_LENGTHS]
    alone = [engine.generate([p], m, stop_token_ids=s)[0]
             for p, m, s in zip(prompts, STAGGERED_MAX_NEW, STAGGERED_STOPS)]
    generations, streamed, resizes, waited = _run_staggered(engine, prompts, monkeypatch)
    assert waited >= 1
    for i, (g, want) in enumerate(zip(generations, alone)):
        if i == CANCELLED:
            assert g.admitted is not None and g.result is None and g.error is None
            continue
        got = g.result
        assert (got.output_ids, got.acceptance_lengths, got.finish_reason) == \
            (want.output_ids, want.acceptance_lengths, want.finish_reason), i
        assert streamed[i] == got.output_ids, i
        assert got.time_to_first_token > 0 and got.time_per_output_token > 0
    assert [len(g.result.output_ids) for g in generations if g.result] != STAGGERED_MAX_NEW  # some stopped early
    assert any(old == 1 and rows == 8 and keep for old, keep, rows in resizes)  # a live row moved up
    assert any(old == 8 and rows == 1 and keep != [0] for old, keep, rows in resizes)  # and compacted down


def test_generate_flows_more_prompts_than_rows(engines):
    """``Engine.generate`` with more prompts than ``max_batch_size``: rows are reused as they free."""
    spec, _ = engines
    rs = np.random.RandomState(3)
    prompts = [rs.randint(0, 95, n).tolist() for n in STAGGERED_LENGTHS]
    stops = (11, 67)
    done: list[int] = []
    got = spec.generate(prompts, list(STAGGERED_MAX_NEW), stop_token_ids=stops, on_done=lambda i, r: done.append(i))
    for p, m, g in zip(prompts, STAGGERED_MAX_NEW, got):
        (want,) = spec.generate([p], m, stop_token_ids=stops)
        assert (g.output_ids, g.acceptance_lengths) == (want.output_ids, want.acceptance_lengths)
    assert sorted(done) == list(range(len(prompts))) and done != sorted(done)  # finished out of order


@pytest.mark.slow
def test_admitting_and_resizing_keep_the_state_sharding(pair):
    """On a mesh, rows scattered into a running state, released and moved to another row count
    keep the state's layout (batch on ``data``, caches on KV heads)."""
    target, drafter = load_target(pair[0]), load_drafter(pair[1])
    engine = Engine(target, drafter, EngineConfig(max_batch_size=4, max_length=80,
                                                  mesh=MeshConfig(data=2, fsdp=1, tensor=4)))

    def assert_pinned(state):
        for x, axes in ((state.tokens, ("batch", "length")), (state.stop_ids, ("batch", "length")),
                        (state.done, ("batch",)), (state.target_cache.k[0], CACHE_AXES),
                        (state.draft_cache.v[-1], CACHE_AXES)):
            want = named_sharding(axes, x.shape, engine.mesh, engine._rules)
            assert x.sharding.is_equivalent_to(want, x.ndim), (axes, x.sharding, want)

    fresh, _ = engine.prefill([[1, 2, 3], [4, 5]], [4, 4], [(), (7,)])
    state = engine.admit(engine.empty_state(4), fresh, [1, 3])
    assert_pinned(state)
    assert np.asarray(state.done).tolist() == [True, False, True, False]
    assert np.asarray(state.stop_ids)[3, :2].tolist() == [7, -1]
    state = engine.release(state, [1])
    assert_pinned(state)
    state = engine.resize(state, [3], rows=1)
    assert np.asarray(state.starts).tolist() == [2] and np.asarray(state.done).tolist() == [False]
    state = engine.resize(state, [0], rows=4)
    assert_pinned(state)
    assert np.asarray(state.done).tolist() == [False, True, True, True]
    # The decode loop's step count goes in replicated over the mesh, not on one device (which made
    # every call take jax's slow argument path); the compiled loop itself is not needed to see it.
    passed = []
    engine._decode = lambda target, drafter, state, n_steps, **_: passed.append(n_steps) or (state, None)
    engine.decode(state, 4)
    (steps,) = passed
    assert int(steps) == 4 and steps.sharding.is_fully_replicated
    assert steps.sharding.device_set == set(engine.mesh.devices.flat)


def test_hlo_collectives_reads_synchronous_and_asynchronous_forms():
    hlo = """
  %all-gather.5 = f32[1,1,96]{1,0,2} all-gather(%fusion), channel_id=11, dimensions={2}, metadata={op_name="jit(f)/argmax"}
  %all-gather-start = (bf16[2,64]{1,0}, bf16[4,64]{1,0}) all-gather-start(%p), channel_id=2, dimensions={0}
  %all-gather-done = bf16[4,64]{1,0} all-gather-done(%all-gather-start)
  %all-reduce-start.1 = bf16[4096]{0} all-reduce-start(%dot), channel_id=3, to_apply=%add, metadata={op_name="jit(f)/dot_general"}
  %all-reduce-done.1 = bf16[4096]{0} all-reduce-done(%all-reduce-start.1)
  %add.3 = f32[8]{0} add(%a, %b)
"""
    got = sharding.hlo_collectives(hlo)
    assert [(c.kind, c.dtype, c.shape, c.op_name) for c in got] == [
        ("all-gather", "f32", (1, 1, 96), "jit(f)/argmax"),
        ("all-gather", "bf16", (4, 64), ""),
        ("all-reduce", "bf16", (4096,), "jit(f)/dot_general"),
    ]
    assert got[1].elements == 256


@pytest.mark.slow
def test_sharded_decode_steps_gather_no_weights_and_no_logits(pair):
    """On a tensor-parallel mesh the compiled decode steps (target-only and DFlash) reduce across
    devices (all-reduces) but gather nothing as large as one row of logits: no weight (e.g. the
    drafter's context-K/V weight gathered whole on every step) and no vocab-sharded logits (an argmax
    over gathered rows of logits, 600 KB per row for Qwen3-8B)."""
    target, drafter = load_target(pair[0]), load_drafter(pair[1])
    vocab = target.config.vocab_size
    for draft in (None, drafter):
        engine = Engine(target, draft, EngineConfig(max_batch_size=1, max_length=80, steps_per_sync=2,
                                                    mesh=MeshConfig(data=1, fsdp=1, tensor=2)))
        collectives = sharding.hlo_collectives(engine.decode_hlo(engine.empty_state(1)))
        gathered = [c.elements for c in collectives if c.kind == "all-gather"]
        assert any(c.kind == "all-reduce" for c in collectives), "the step is not partitioned"
        assert max(gathered, default=0) < vocab, (draft is not None, gathered, vocab)


def test_derived_engines_share_the_target_copy_and_generate_as_new_ones(models, prompts, engines):
    """``Engine.derive``: another configuration over the same serving copy of the target (its arrays are
    this engine's, not copies), target-only or with another drafter, and the same generations as an
    engine built from the modules."""
    target, drafter = models
    spec, plain = engines
    config = EngineConfig(max_batch_size=8, max_length=80, steps_per_sync=2)
    derived_plain = spec.derive(config, drafter=None)
    assert all(a is b for a, b in zip(derived_plain._target_state, spec._target_state))
    assert derived_plain.drafter is None and spec.derive(config).drafter is spec.drafter
    _assert_same_generations(derived_plain.generate(prompts, 12), plain.generate(prompts, 12))
    other = random_drafter(drafter.config, seed=5)
    derived = plain.derive(config, drafter=other)
    assert all(a is b for a, b in zip(derived._target_state, plain._target_state))
    _assert_same_generations(derived.generate(prompts, 12), Engine(target, other, config).generate(prompts, 12))


@pytest.mark.slow
def test_engine_derived_on_a_mesh_keeps_its_shards(pair, prompts, engines):
    """A target-only engine derived from a sharded speculative one runs on its sharded arrays (the same
    objects, not resharded copies) and generates the one-device target-only engine's tokens."""
    _, plain = engines
    target, drafter = load_target(pair[0]), load_drafter(pair[1])
    config = EngineConfig(max_batch_size=4, max_length=80, steps_per_sync=4, mesh=MeshConfig(data=2, fsdp=1, tensor=4))
    sharded = Engine(target, drafter, config)
    derived = sharded.derive(config, drafter=None)
    assert derived.mesh is sharded.mesh
    assert all(a is b for a, b in zip(derived._target_state, sharded._target_state))
    assert {len(a.sharding.device_set) for a in derived._target_state} == {8}
    _assert_same_generations(derived.generate(prompts[:4], 16), plain.generate(prompts[:4], 16))


def test_derive_refuses_what_an_engine_would_naming_it(models, engines):
    target, drafter = models
    spec, _ = engines
    with pytest.raises(ValueError, match="serving layout"):
        spec.derive(drafter=spec.drafter)  # an engine's copy, not a module in its checkpoint layout
    wrong = random_drafter(dataclasses.replace(drafter.config, vocab_size=drafter.config.vocab_size + 1), seed=0)
    with pytest.raises(ValueError, match="drafter vocab_size"):
        spec.derive(drafter=wrong)
    with pytest.raises(ValueError, match="config.mesh differs"):
        spec.derive(dataclasses.replace(spec.config, mesh=MeshConfig(data=1, fsdp=1, tensor=2)))
    with pytest.raises(ValueError, match="drafter must be 'same', None or a Drafter"):
        spec.derive(drafter="other")
    with pytest.raises(ValueError, match="block_size"):
        spec.derive(dataclasses.replace(spec.config, block_size=spec.drafter.config.block_size + 8))


def test_pool_is_sized_from_the_memory_left_once_the_loaded_modules_are_dropped(monkeypatch):
    """``kv_memory_fraction`` sizes the pool when it is first needed: the checkpoint-layout modules the
    engine was built from (``serving.cli.load_engine`` drops them) then no longer count against it."""
    import gc

    from dflash_jax.runtime import engine as engine_module

    limit = 64 << 20

    class Device:  # a device whose used memory is the live arrays'
        def memory_stats(self):
            return {"bytes_limit": limit, "bytes_in_use": sum(a.nbytes for a in jax.live_arrays())}

    monkeypatch.setattr(engine_module.jax, "devices", lambda *a: [Device()])
    tcfg = tiny_target_config(vocab_size=96, hidden_size=64, intermediate_size=1024)
    target = random_target(tcfg, seed=0)
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=64, page_size=16,
                                               kv_memory_fraction=0.5))
    held = Device().memory_stats()["bytes_in_use"]
    del target
    gc.collect()
    freed = held - Device().memory_stats()["bytes_in_use"]
    assert freed > 0  # the checkpoint layout's projections: the engine holds fused copies
    want = int(0.5 * (limit - Device().memory_stats()["bytes_in_use"])) // engine.page_bytes() + 1
    assert engine.num_pages == want
    assert want > int(0.5 * (limit - held)) // engine.page_bytes() + 1


def test_engine_arguments_of_another_kind_and_lengths_past_the_targets_positions_are_errors():
    """A drafter passed as the target (or the reverse), a dict as the config and a ``max_length`` past the
    target's ``max_position_embeddings`` are errors naming them; ``generate`` with an unbounded
    ``max_new_tokens`` stops at the target's positions instead of sizing caches for it."""
    import dflash_jax as dj

    tcfg = tiny_target_config(max_position_embeddings=40)
    target, drafter = random_target(tcfg), random_drafter(tiny_drafter_config(tcfg, num_layers=1, block_size=4))
    with pytest.raises(TypeError, match="target must be a target model.*a drafter: pass it second"):
        Engine(drafter, None)
    with pytest.raises(TypeError, match="drafter must be a drafter.*a target: pass it first"):
        Engine(target, target)
    with pytest.raises(TypeError, match="config must be an EngineConfig, got dict"):
        Engine(target, drafter, {})
    with pytest.raises(ValueError, match="max_length 41 exceeds the target's max_position_embeddings 40"):
        Engine(target, drafter, EngineConfig(max_length=41))
    (result,) = dj.generate(target, drafter, [[1, 2, 3]], 10 ** 9)
    assert len(result.output_ids) == 37 and result.finish_reason == "length"
