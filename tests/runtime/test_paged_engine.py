"""A paged engine (``EngineConfig.page_size``) generates what the contiguous one does, token for token,
with prefix hits of every kind, batched or alone, and gives every page back."""

import dataclasses
import json
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dflash_jax import ContinuousBatcher, Engine, EngineConfig, load_target
from dflash_jax.runtime.batcher import Generation, _keep_emitted
from dflash_jax.runtime.sampling import SamplingParams
from dflash_jax.tiny import write_copycat_pair

PAGE = 8
MAX_NEW = 24
CONFIG = dict(max_batch_size=4, max_length=96, steps_per_sync=4, prompt_buckets=(64,))


@pytest.fixture(scope="module")
def engines(models):
    target, drafter = models
    return Engine(target, drafter, EngineConfig(**CONFIG)), Engine(target, drafter, EngineConfig(page_size=PAGE, **CONFIG))


@pytest.fixture(scope="module")
def base():
    return np.random.RandomState(1).randint(0, 95, 40).tolist()  # five full pages


def _run(batcher, prompts, sampling=None):
    generations = [batcher.submit(p, MAX_NEW, [11], sampling=sampling) for p in prompts]
    batcher.run()
    for g in generations:
        assert g.error is None, g.error
    return generations


def _solo(engine, prompt, sampling=None):
    return engine.generate([prompt], MAX_NEW, [11], sampling=sampling)[0]


def test_engine_config_checks_the_page_settings():
    for bad in (dict(page_size=3), dict(page_size=256), dict(page_size=-1), dict(num_pages=0),
                dict(kv_memory_fraction=1.5), dict(page_size=8, num_pages=10, kv_memory_fraction=0.5),
                dict(page_size=8, max_preemptions=-1)):
        with pytest.raises(ValueError):
            EngineConfig(**bad).validate()


def test_a_resumed_row_goes_on_from_the_token_it_emitted():
    """A resumption's prefill that draws another first token than the one emitted before (rounding) is
    overruled, so the row continues from what the client has; a fresh request's token stands."""
    rows = _Rows(tokens=jnp.zeros((2, 8), jnp.int32), done=jnp.array([True, True]))
    resumed = Generation(prompt_ids=[1, 2, 3], max_len=8, stop_token_ids=(), on_tokens=None, on_finish=None,
                         submitted=0.0, output_ids=[4, 5])
    fresh = Generation(prompt_ids=[1, 2], max_len=8, stop_token_ids=(), on_tokens=None, on_finish=None, submitted=0.0)
    got = _keep_emitted(rows, np.array([6, 6]), [resumed, fresh], [resumed.context_ids, fresh.context_ids])
    assert resumed.context_ids == [1, 2, 3, 4]
    assert got.tokens[0].tolist() == [0, 0, 0, 0, 5, 0, 0, 0] and got.tokens[1].tolist() == [0] * 8
    assert got.done.tolist() == [False, True]
    assert _keep_emitted(rows, np.array([5, 6]), [resumed, fresh], [resumed.context_ids, fresh.context_ids]) is rows


@dataclasses.dataclass
class _Rows:
    tokens: jax.Array
    done: jax.Array


@pytest.mark.slow
def test_paged_engine_equals_contiguous_with_prefix_hits_and_no_leaked_pages(engines, base):
    contiguous, paged = engines
    rs = np.random.RandomState(2)
    tail = rs.randint(0, 95, 10).tolist()
    # The first request fills the cache; then, batched together: a hit ending inside a page (20 of its
    # tokens: 2 full pages), the same prompt again (entirely cached: its last page computed again),
    # the prompt extended (all 5 pages), one page shared, and a prompt with nothing cached.
    later = [base[:20] + tail, base, base + tail, base[:PAGE] + tail[:3], tail + base[:5]]
    batcher = ContinuousBatcher(paged)
    first = _run(batcher, [base])[0]
    got = _run(batcher, later)
    assert [g.cached_tokens for g in got] == [16, 32, 40, PAGE, 0]
    for g, prompt in zip([first] + got, [base] + later):
        want = _solo(contiguous, prompt)
        assert g.result.output_ids == want.output_ids, prompt
        assert g.result.acceptance_lengths == want.acceptance_lengths
    assert batcher.pages.all_free()
    stats = batcher.pages.stats()
    assert stats.prefix_hits == sum(g.cached_tokens for g in got) and stats.in_use == 0


@pytest.mark.slow
def test_paged_rows_alone_equal_batched_and_sampled_rows_keep_their_tokens(engines, base):
    contiguous, paged = engines
    prompts = [base[:13], base[3:30], base[:5]]
    batched = _run(ContinuousBatcher(paged), prompts)
    for g, prompt in zip(batched, prompts):
        assert g.result.output_ids == _solo(paged, prompt).output_ids == _solo(contiguous, prompt).output_ids
    sampling = SamplingParams(temperature=0.8, seed=7)
    batcher = ContinuousBatcher(paged)
    _run(batcher, [base])
    hit = _run(batcher, [base + [3, 4]], sampling=sampling)[0]
    assert hit.cached_tokens == 40
    assert hit.result.output_ids == _solo(contiguous, base + [3, 4], sampling=sampling).output_ids
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_requests_wait_for_pages_and_too_large_ones_are_refused(models, base):
    target, drafter = models
    # 13 pages: one request of 40 + 24 positions takes 8, so two never run at once
    engine = Engine(target, drafter, EngineConfig(page_size=PAGE, num_pages=13, **CONFIG))
    batcher = ContinuousBatcher(engine)
    small = ContinuousBatcher(Engine(target, drafter, EngineConfig(page_size=PAGE, num_pages=4, **CONFIG)))
    with pytest.raises(ValueError, match="needs 8 pages"):
        small.submit(base, MAX_NEW)
    prompts = [base, base[::-1]]
    got = _run(batcher, prompts)
    for g, prompt in zip(got, prompts):
        assert g.result.output_ids == _solo(engine, prompt).output_ids
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_chunked_prefill_interleaves_with_decoding_and_keeps_the_tokens(models, engines, base):
    target, drafter = models
    contiguous, _ = engines
    engine = Engine(target, drafter, EngineConfig(page_size=PAGE, prefill_chunk=2 * PAGE, **CONFIG))
    batcher = ContinuousBatcher(engine)
    running = batcher.submit(base[:6], MAX_NEW, [11])
    batcher.step()  # admitted, decoding
    long = batcher.submit(base + base[:7], MAX_NEW, [11])  # 47 tokens: chunks of 16, 16, then 15 at admission
    steps_before_admission = 0
    while long.admitted is None:
        batcher.step()
        steps_before_admission += 1
    assert steps_before_admission == 3 and long.cached_tokens == 32  # two chunk syncs, then the admission
    assert len(running.output_ids) > 1  # the running row decoded between the chunks
    batcher.run()
    for g, prompt in ((running, base[:6]), (long, base + base[:7])):
        assert g.error is None
        assert g.result.output_ids == _solo(contiguous, prompt).output_ids
    assert batcher.pages.all_free()
    with pytest.raises(ValueError, match="prefill_chunk"):
        EngineConfig(page_size=PAGE, prefill_chunk=12).validate()


@pytest.mark.slow
def test_rows_ended_on_the_host_or_cancelled_give_their_pages_back(engines, base):
    contiguous, paged = engines
    batcher = ContinuousBatcher(paged)
    want = _solo(contiguous, base[:20])
    stopped = batcher.submit(base[:20], MAX_NEW, [11], stop_check=lambda new: 1 if len(new) > 1 else None)
    cancelled = batcher.submit(base[5:30], MAX_NEW, [11])
    kept = batcher.submit(base[:20] + [4, 5], MAX_NEW, [11])
    batcher.step()
    batcher.step()
    cancelled.cancel()
    batcher.run()
    assert cancelled.result is None
    assert stopped.result.finish_reason == "stop" and stopped.result.output_ids == want.output_ids[:len(
        stopped.result.output_ids)]
    assert kept.result.output_ids == _solo(contiguous, base[:20] + [4, 5]).output_ids
    assert batcher.pages.all_free()
    # what they left cached serves a later prompt, unchanged
    again = _run(batcher, [base[:20] + [4, 5]])[0]
    assert again.cached_tokens == 16 and again.result.output_ids == kept.result.output_ids
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_target_only_paged_engine_equals_contiguous_with_a_prefix_hit(models, base):
    target, _ = models
    contiguous = Engine(target, None, EngineConfig(**CONFIG))
    paged = Engine(target, None, EngineConfig(page_size=PAGE, **CONFIG))
    batcher = ContinuousBatcher(paged)
    prompts = [base, base[:30] + [7, 8, 9]]
    got = _run(batcher, prompts[:1]) + _run(batcher, prompts[1:])
    assert got[1].cached_tokens == 24
    for g, prompt in zip(got, prompts):
        assert g.result.output_ids == _solo(contiguous, prompt).output_ids
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_paged_engine_with_the_kernels_equals_contiguous(models, engines, base):
    """The paged views through the cached-attention kernel (interpret mode here), as on a GPU."""
    target, drafter = models
    contiguous, _ = engines
    paged = Engine(target, drafter, EngineConfig(page_size=PAGE, attention_impl="pallas", **CONFIG))
    batcher = ContinuousBatcher(paged)
    prompts = [base, base + [3, 4, 5]]
    got = _run(batcher, prompts[:1]) + _run(batcher, prompts[1:])
    assert got[1].cached_tokens == 40
    for g, prompt in zip(got, prompts):
        assert g.result.output_ids == _solo(contiguous, prompt).output_ids
    assert batcher.pages.all_free()


@pytest.mark.parametrize("took_the_state", [False, True])
def test_a_failed_paged_prefill_fails_its_prompt_and_the_rows_only_if_it_took_their_state(engines, base,
                                                                                         took_the_state, monkeypatch):
    """A prefill over a cached prefix is donated the running state. One that fails before it runs (a trace or
    compile error) fails its own prompt and the running row goes on; one that fails while running has
    consumed the state, so the running row fails too, its pages go back, and the batcher serves on. (The
    module's paged engine: the pools and the rows' state are the batcher's, so a fresh batcher starts clean.)"""
    contiguous, engine = engines
    batcher = ContinuousBatcher(engine)
    _run(batcher, [base])  # the prefix now cached
    running = batcher.submit(base[:17], MAX_NEW, [11])
    batcher.step()
    real = engine._paged_prefill

    def failing(*args, **kwargs):
        if took_the_state:
            for x in jax.tree.leaves(args[2]):
                x.delete()  # what a donated call that failed on the device leaves
        raise RuntimeError("prefill failed")

    monkeypatch.setattr(engine, "_paged_prefill", failing)
    late = batcher.submit(base + [3, 4, 5], MAX_NEW, [11])
    batcher.step()
    monkeypatch.setattr(engine, "_paged_prefill", real)
    batcher.run()
    assert isinstance(late.error, RuntimeError)
    if took_the_state:
        assert running.error is late.error  # failed with it, not later on the deleted state
    else:
        assert running.error is None
        assert running.result.output_ids == _solo(contiguous, base[:17]).output_ids
    after = _run(batcher, [base + [3, 4, 5]])[0]
    assert after.result.output_ids == _solo(contiguous, base + [3, 4, 5]).output_ids
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_rows_preempted_for_pages_resume_with_their_solo_output(models, engines, base):
    """A pool too small for every row at once: rows get pages as they advance, the newest are paused
    when the pool runs dry and resume from the prefix cache, each with its solo output, token for token."""
    target, drafter = models
    contiguous, _ = engines
    # steps_per_sync 1: a row is admitted with its prompt and 8 positions (one block), then grows.
    engine = Engine(target, drafter, EngineConfig(page_size=PAGE, num_pages=10, **dict(CONFIG, steps_per_sync=1)))
    batcher = ContinuousBatcher(engine)
    with pytest.raises(ValueError, match="needs 12 pages"):  # larger than the whole pool alone
        batcher.submit(base, 60)
    # The last one's penalties depend on its output's history, which a resumption would not restore: it
    # gets its whole length at admission and is never preempted.
    prompts = [base[:10], base[5:20], base[20:32], base[:10] + [3, 1]]
    sampled = SamplingParams(temperature=0.8, seed=5, logprobs=2)
    samplings = [None, None, sampled, SamplingParams(frequency_penalty=0.5)]
    new_tokens = 48  # each request takes 8 or 9 pages alone, of 10
    generations = [batcher.submit(p, new_tokens, sampling=s) for p, s in zip(prompts, samplings)]
    batcher.run()
    assert batcher.preemptions > 0 and batcher.page_stats().preemptions == batcher.preemptions
    assert any(g.preemptions for g in generations) and generations[3].preemptions == 0
    for g, prompt, sampling in zip(generations, prompts, samplings):
        assert g.error is None, g.error
        want = contiguous.generate([prompt], new_tokens, sampling=sampling)[0]
        assert g.result.output_ids == want.output_ids, (prompt, g.preemptions)
        assert g.result.acceptance_lengths == want.acceptance_lengths
        assert g.result.num_steps == want.num_steps
        if sampling is sampled:  # the logprobs of tokens emitted before a preemption are not repeated
            assert len(g.result.logprobs) == len(want.output_ids)
            np.testing.assert_allclose(g.result.logprobs, want.logprobs, rtol=1e-5, atol=1e-5)
            assert [list(d) for d in g.result.top_logprobs] == [list(d) for d in want.top_logprobs]
    assert batcher.pages.all_free()


@pytest.mark.slow
def test_paged_engine_with_a_drafter_context_window_equals_contiguous(models, base):
    """The drafter's context window reads a window of each row's positions through its page table."""
    target, drafter = models
    config = dict(CONFIG, drafter_context_window=16)
    prompts = [base, base[:13]]
    want = Engine(target, drafter, EngineConfig(**config)).generate(prompts, MAX_NEW, [11])
    got = Engine(target, drafter, EngineConfig(page_size=PAGE, **config)).generate(prompts, MAX_NEW, [11])
    assert [r.output_ids for r in got] == [r.output_ids for r in want]


def test_a_paged_decode_step_holds_no_copy_of_the_caches(models):
    """The step reads and writes the pools through the page tables: its compiled program needs no more
    scratch memory than the contiguous step's (a contiguous view of every layer's pages would add the
    caches' size again)."""
    target, drafter = models
    config = dict(CONFIG, max_length=1024)
    temp = {}
    for page_size in (0, PAGE):
        engine = Engine(target, drafter, EngineConfig(page_size=page_size, **config))
        compiled = engine.decode_compiled(engine.empty_state(4), 1, window=1024)
        temp[page_size] = compiled.memory_analysis().temp_size_in_bytes
    assert temp[PAGE] <= 1.01 * temp[0], temp


_PREFILL_MEMORY = """
import json, sys
from dflash_jax import Engine, EngineConfig, load_drafter, load_target
target, drafter = load_target(sys.argv[1]), load_drafter(sys.argv[2])
temp = {}
for pool in (160, 640):
    engine = Engine(target, drafter, EngineConfig(page_size=8, max_batch_size=2, max_length=1024, num_pages=pool))
    state = engine.empty_state(2)
    for pages in (16, 64):
        compiled, _ = engine.prefill_paged_compiled(state, 2, 16, context_pages=pages)
        memory = compiled.memory_analysis()
        temp[f"{pool},{pages}"] = memory.temp_size_in_bytes if memory.alias_size_in_bytes else None
print(json.dumps(temp))
"""


@pytest.mark.slow
def test_a_prefill_over_a_cached_prefix_copies_neither_the_pools_nor_a_view_of_every_layer(tmp_path):
    """The suffix runs through the page tables and writes the (donated) pools in place, as a decode step
    does: its program's scratch memory does not grow with the pool, and grows with the cached prefix by
    less than a contiguous view of the prefix's pages in every layer and its padded copy (how it was once
    read). With XLA:CPU's own emitters, as users run it (the suite's classic emitters expand a scatter
    into a loop that copies its operand), so in a process of its own."""
    target_dir, drafter_dir = write_copycat_pair(tmp_path, block_size=8)
    flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split() if "fusion_emitters" not in f)
    out = subprocess.run([sys.executable, "-c", _PREFILL_MEMORY, str(target_dir), str(drafter_dir)],
                         env=dict(os.environ, XLA_FLAGS=flags), capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    temp = json.loads(out.stdout.splitlines()[-1])
    assert None not in temp.values(), temp  # every program aliases the pools it was given
    assert temp["640,16"] == temp["160,16"] and temp["640,64"] == temp["160,64"], temp
    tc = load_target(target_dir).config
    view = 2 * 2 * tc.num_layers * 48 * PAGE * tc.num_kv_heads * tc.head_dim * 4  # 48 pages: rows, K and V, float32
    assert temp["160,64"] - temp["160,16"] < 2 * view, (temp, view)


def test_adaptive_speculation_on_pages_generates_the_contiguous_tokens(engines, base):
    """``engine.speculation: adaptive`` on a paged engine: its step costs are timed on rows admitted into
    pages (``calibrate_speculation`` on the contiguous path failed on a paged state), and the blocks it
    chooses give the tokens of the fixed-block contiguous engine, prefix hits included."""
    contiguous, paged = engines
    adaptive = paged.derive(dataclasses.replace(paged.config, speculation="adaptive"))
    costs = adaptive.calibrate_speculation()
    assert {block for _, block in costs} == set(adaptive.speculation_blocks) and min(costs.values()) > 0
    prompts = [base + [5, 6, 7], base[:20] + [9] * 9, base[:33]]
    batcher = ContinuousBatcher(adaptive)
    got = _run(batcher, prompts[:1]) + _run(batcher, prompts[1:])  # the later two on the first one's pages
    for g, p in zip(got, prompts):
        assert g.result.output_ids == _solo(contiguous, p).output_ids
    assert max(g.cached_tokens for g in got) > 0


@pytest.mark.slow
@pytest.mark.parametrize("case", ["dflash2", "drafter_window", "qwen3_moe", "gpt_oss", "llama"])
def test_other_families_and_drafters_on_pages_equal_target_only(case, base):
    """Pages, and prefix hits on them, under the other model families (mixtures of experts; gpt-oss's sinks
    and sliding windows), a DFlash2 drafter and a windowed drafter context: the target-only greedy tokens.
    The mixtures of experts (the attention's reference path, over each layer's pages gathered) also give
    the contiguous speculative engine's tokens, prompts batched without a prefix cache. Targets of two
    layers (gpt-oss: a sliding one and a full one; Qwen3-MoE: a sparse one and a dense one), each tapped
    by the drafter."""
    from dflash_jax.tiny import (random_drafter, random_target, tiny_dflash2_config, tiny_drafter_config,
                                 tiny_target_config)

    family = case if case in ("qwen3_moe", "gpt_oss", "llama") else "qwen3"
    tc = tiny_target_config(family, num_layers=2)
    target = random_target(tc)
    make = tiny_dflash2_config if case == "dflash2" else tiny_drafter_config
    drafter = random_drafter(make(tc, block_size=8, mask_token_id=1))
    config = EngineConfig(max_batch_size=4, max_length=96, steps_per_sync=4, prompt_buckets=(64,),
                          drafter_context_window=16 if case == "drafter_window" else 0)
    rs = np.random.RandomState(3)
    shared = rs.randint(0, 90, 40).tolist()
    prompts = [shared + [3, 4], shared[:24] + [7] * 5, rs.randint(0, 90, 13).tolist()]
    plain = Engine(target, None, config)
    paged = plain.derive(dataclasses.replace(config, page_size=PAGE), drafter=drafter)
    batcher = ContinuousBatcher(paged)
    generations = _run(batcher, prompts[:1]) + _run(batcher, prompts[1:])  # the second on the first's pages
    assert [g.result.output_ids for g in generations] == [r.output_ids for r in plain.generate(prompts, MAX_NEW, [11])]
    assert generations[1].cached_tokens == 24 and batcher.pages.all_free()
    if case in ("qwen3_moe", "gpt_oss"):
        batched = [base, base[:13]]
        want = plain.derive(config, drafter=drafter).generate(batched, MAX_NEW, [11])
        assert [r.output_ids for r in paged.generate(batched, MAX_NEW, [11])] == [r.output_ids for r in want]


def test_paged_caches_refuse_a_mesh_that_splits_the_rows(models):
    """Pools are shared by every row, so a mesh that splits rows (``data`` or ``fsdp`` > 1) cannot hold one
    pool per row shard; the error names the settings to change."""
    from dflash_jax.sharding import MeshConfig

    target, drafter = models
    with pytest.raises(ValueError, match=r"engine.mesh.*data: 1.*fsdp: 1"):
        Engine(target, drafter, EngineConfig(page_size=PAGE, mesh=MeshConfig(data=2, fsdp=1, tensor=2), **CONFIG))


@pytest.mark.slow
@pytest.mark.parametrize("attention_impl", ["xla", "pallas"])
def test_paged_engine_on_a_tensor_mesh_equals_one_device(models, engines, base, attention_impl):
    """On a 1 x 2 (data x tensor) mesh the pools are split by KV head (each device holds its heads of every
    page) and the page tables are whole on each: prefix hits, a chunked prompt and batched rows give the
    one-device contiguous engine's tokens and acceptance lengths (the kernels, interpreted here, run per
    device through ``shard_kernel``), and every page comes back."""
    from dflash_jax.sharding import MeshConfig

    target, drafter = models
    contiguous, _ = engines
    assert target.config.num_kv_heads % 2 == 0 and drafter.config.num_kv_heads % 2 == 0
    engine = Engine(target, drafter, EngineConfig(page_size=PAGE, prefill_chunk=2 * PAGE, attention_impl=attention_impl,
                                                  mesh=MeshConfig(data=1, fsdp=1, tensor=2), **CONFIG))
    batcher = ContinuousBatcher(engine)
    first = _run(batcher, [base])[0]
    # a hit inside a page, the prompt extended (all pages cached), nothing cached and a long prompt in chunks
    later = [base[:20] + [7, 8, 9], base + [3, 4], base[::-1][:9], base[::-1] + base[:7]]
    got = _run(batcher, later)
    assert [g.cached_tokens for g in got][:3] == [16, 40, 0]
    for g, prompt in zip([first] + got, [base] + later):
        want = _solo(contiguous, prompt)
        assert g.result.output_ids == want.output_ids, prompt
        assert g.result.acceptance_lengths == want.acceptance_lengths
    assert batcher.pages.all_free()
    state = engine.empty_state(engine.state_rows(2))
    for pools, kv_heads in ((state.target_cache, target.config.num_kv_heads),
                            (state.draft_cache, drafter.config.num_kv_heads)):
        pool = pools.k[0]
        assert {s.data.shape[2] for s in pool.addressable_shards} == {kv_heads // 2}
        assert len(pool.sharding.device_set) == 2
    assert len(state.page_table.sharding.device_set) == 2 and state.page_table.sharding.is_fully_replicated
    assert engine.page_bytes() * 2 == engines[1].page_bytes()  # what kv_memory_fraction sizes: a device's share
