"""The warm-up plan: every shape a server meets, a lone request's first; the shapes of a lone short
request, which serve.py compiles before it binds, the rest (sampled decoding among them) after; after
it, a request's ``n`` > 1 choices sharing its prompt's prefill and a sampled request with logprobs
compile nothing."""

from __future__ import annotations

import dataclasses
import gc
from collections import Counter
from contextlib import contextmanager

import jax
import numpy as np
import pytest

from dflash_jax import ContinuousBatcher, SamplingParams
from dflash_jax.runtime.engine import Engine, EngineConfig
from dflash_jax.runtime.sampling import SamplingFlags
from dflash_jax.runtime.warmup import (Shape, compiles_prefill, first_request_shapes, run_warmup, sampling_flags, staged_plan,
                                       warmup_plan)
from dflash_jax.tiny import random_target, tiny_target_config


@pytest.fixture(scope="module")
def target():
    """Two layers: what a warm-up compiles depends on the shapes, not the depth; each layer more is
    compile time in every program of every warm-up here."""
    return random_target(tiny_target_config(num_layers=2))


def test_plan_lists_every_shape_a_server_meets_a_lone_request_first(target):
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=100, steps_per_sync=4))
    plan = warmup_plan(engine)
    assert len(plan) == len(set(plan))
    counts = Counter(s.phase for s in plan)
    windows, buckets = len(engine.windows), len(engine.prompt_buckets())
    # decode per running state (1 and 2 rows) and window; a lone request's prefill into its own row per
    # bucket (an admission into 1 row, one program); prefills of 1 and 2 rows per bucket, and of one
    # prompt's 2 choices, each admitted into the 2-row state; resizes both ways; a release per state
    assert counts == {"decode": 2 * windows, "prefill": 3 * buckets, "admit": 3 * buckets, "resize": 2, "release": 2}
    shared = [s for s in plan if s.distinct]
    assert shared == [Shape("prefill", 2, b, distinct=1) for b, _ in engine.prompt_buckets()]
    assert plan.index(shared[0]) > max(i for i, s in enumerate(plan) if s.phase == "admit")  # after the batch's own
    lone = [s for s in plan if s.rows == 1 and s.phase == "decode" or s.into == 1 and s.phase == "admit"]
    assert all(compiles_prefill(engine, s) for s in lone if s.phase == "admit")
    assert plan[:len(lone)] == lone  # what a lone request runs comes first
    assert plan[0] == Shape("decode", 1, engine.windows[0])
    assert warmup_plan(engine, [1]) == [s for s in lone] + [Shape("release", 1)]


def test_first_request_shapes_cover_the_windows_the_host_picks(target):
    engine = Engine(target, None, EngineConfig(max_batch_size=8, max_length=2048, steps_per_sync=8))
    plan = warmup_plan(engine)
    first = first_request_shapes(engine, plan, 64, 256)
    # a 1..64-token prompt in buckets 16, 32, 64; its calls' windows cover start + 8 steps of one token
    # (>= 9: 64) up to the last token it can write (64 + 256 - 2 + 1: 512)
    # its prefill into a state of its own (one program a bucket): no prefill of rows to admit
    assert [s for s in first if s.phase != "decode"] == [Shape("admit", 1, b, 1) for b in (16, 32, 64)]
    assert str(first[-1]) == "a lone request's prefill into its own row, prompt bucket 64"
    assert [s.size for s in first if s.phase == "decode"] == [64, 128, 256, 512]
    assert all(s in plan for s in first) and len(first) < len(plan) / 4
    assert str(first[0]) == "decode, 1 row, attention window 64"


def test_plan_shares_a_prompt_over_every_prefill_row_count_above_one(target):
    engine = Engine(target, None, EngineConfig(max_batch_size=6, max_length=100, prompt_buckets=(16, 64)))
    plan = warmup_plan(engine)
    assert [(s.rows, s.size) for s in plan if s.distinct] == [(2, 16), (2, 64), (4, 16), (4, 64), (8, 16), (8, 64)]
    assert all(s.distinct == 1 for s in plan if s.distinct)
    assert str(Shape("prefill", 4, 16, distinct=1)) == "prefill, 4 rows sharing 1 prompt, prompt bucket 16"
    assert not any(s.distinct for s in warmup_plan(engine, [1]))  # no batch: no choices to share a prompt
    assert not any(s.distinct for s in first_request_shapes(engine, plan, 32, 64))  # compiled after binding


def test_sampled_decoding_is_planned_after_binding(target):
    """``server.warmup_sampling`` entries as decode flags: each one more decode per state and window,
    none of them before binding; a lone short request sampled is the first thing compiled after the
    lone request's other prompt buckets."""
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=100, steps_per_sync=4))
    top = engine.config.max_logprobs
    flags = sampling_flags(["sample", "sample + top_logprobs", "sample"], top)
    assert flags == [SamplingFlags(sample=True), SamplingFlags(sample=True, logprobs=top)]
    # what the batcher computes for a request at T = 0.7 with logprobs, alone or beside greedy rows
    asked = [SamplingParams(temperature=0.7, seed=3, logprobs=2), SamplingParams()]
    assert SamplingFlags.of(asked, top) == flags[1] and SamplingFlags.of(asked[:1], top) == flags[1]
    assert sampling_flags(["logprobs", "penalties", "sample+top_k=40+top_p"], top) == [
        SamplingFlags(logprobs=0), SamplingFlags(edits=True),
        SamplingFlags(sample=True, top_k=True, top_p=True, top_k_candidates=64)]
    greedy, plan = warmup_plan(engine), warmup_plan(engine, sampling=flags)
    decodes = [s for s in greedy if s.phase == "decode"]
    assert [s for s in plan if s.phase == "decode" and s.sampling in flags] == [
        dataclasses.replace(s, sampling=f) for s in decodes for f in flags]
    assert [s for s in plan if s.phase != "decode"] == [s for s in greedy if s.phase != "decode"]
    first, rest = staged_plan(engine, plan, 32, 64)
    assert first == first_request_shapes(engine, greedy, 32, 64)  # binding waits for nothing more
    assert sorted(first + rest, key=plan.index) == plan
    lone = [s for f in flags for s in first_request_shapes(engine, plan, 32, 64, sampling=f) if s.phase == "decode"]
    assert [dataclasses.replace(s, sampling=None) for s in lone] == [s for s in first if s.phase == "decode"] * 2
    prefills = [s for s in rest if s.phase == "admit" and s.rows == s.into == 1]
    assert rest[:len(prefills) + len(lone)] == prefills + lone
    assert str(lone[-1]) == f"decode, sample+top_logprobs, 1 row, attention window {lone[-1].size}"


@contextmanager
def _compilations():
    """The XLA compilations while the block runs (JAX reports each one's duration)."""
    compiles: list[str] = []
    listening = [True]

    def listen(event: str, duration: float, **_) -> None:
        if event == "/jax/core/compile/backend_compile_duration" and listening[0]:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listen)
    try:
        yield compiles
    finally:
        listening[0] = False


def _serve_warmup(engine, warmup_sampling: list[str]) -> None:
    """serve.py's staged warm-up with ``server.warmup_sampling`` = ``warmup_sampling``: the first
    request's shapes, then the rest as its background thread compiles them (a runner of its own)."""
    plan = warmup_plan(engine, sampling=sampling_flags(warmup_sampling, engine.config.max_logprobs))
    first, rest = staged_plan(engine, plan, 32, 8)
    assert all(s.sampling is None for s in first)
    for part in (first, rest):
        assert run_warmup(engine, part) == len(part)


@pytest.mark.slow
def test_after_warmup_a_request_of_three_choices_compiles_nothing(target):
    """Three sampled choices of one prompt, submitted together as the server submits a request's ``n``:
    one prefill of the prompt on one row copied to four (its shared prefill), admitted into the batch's
    state, decoded sampled: all compiled by the warm-up. Choices of two prompts in one prefill are not
    in the plan: they compile when first met (which shows the listener hears a prefill's compile)."""
    engine = Engine(target, None, EngineConfig(max_batch_size=4, max_length=48, steps_per_sync=4,
                                               prompt_buckets=(16,)))
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    _serve_warmup(engine, ["sample", "sample+top_logprobs"])
    prompt = np.random.RandomState(5).randint(0, 95, 11).tolist()
    batcher = ContinuousBatcher(engine)
    with _compilations() as compiles:
        choices = [batcher.submit(prompt, 8, sampling=p) for p in params]
        batcher.run()
        logged = batcher.submit(prompt[:7], 8, sampling=SamplingParams(temperature=0.7, seed=4, logprobs=2))
        batcher.run()
    assert compiles == []
    assert engine.prefilled_prompts == 2 and len({tuple(g.result.output_ids) for g in choices}) == 3
    assert len(logged.result.top_logprobs) == 8 and all(len(top) == 2 for top in logged.result.top_logprobs)
    with _compilations() as compiles:
        for p, sampling in zip((prompt, prompt[:5], prompt), params):
            batcher.submit(p, 8, sampling=sampling)
        batcher.run()
    assert compiles and engine.prefilled_prompts == 4


def test_paged_plan_admits_prompts_with_nothing_cached_into_each_state(target):
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=100, page_size=8, prompt_buckets=(16, 64)))
    plan = warmup_plan(engine)
    assert not [s for s in plan if s.phase == "prefill"]  # a paged prefill compiles with its admission's state
    assert [s for s in plan if s.distinct] == [Shape("admit", 2, b, 2, distinct=1) for b in (16, 64)]
    assert [s for s in plan if s.phase == "pages"] == [Shape("pages", 1), Shape("pages", 2)]
    assert plan.index(Shape("pages", 1)) == len(engine.windows)  # after the lone row's decode
    first = first_request_shapes(engine, plan, 32, 64)
    assert [s for s in first if s.phase != "decode"] == [Shape("pages", 1), Shape("admit", 1, 16, 1),
                                                         Shape("admit", 1, 64, 1)]


def test_paged_kernel_plan_admits_over_cached_prefixes_after_everything_else(target):
    """With the kernels a prefill over cached prefixes reads every page (one program per row count and
    bucket of the rest): each admission has a twin over cached prefixes, after the other shapes and not
    before the server binds; a chunk's write follows. The XLA attention's, whose page count follows the
    prefix, has none."""
    config = EngineConfig(max_batch_size=2, max_length=100, page_size=8, prompt_buckets=(16, 64), prefill_chunk=16)
    xla = Engine(target, None, config)
    assert xla.context_pages(8) == 1 and xla.context_pages(40) == 8
    assert not [s for s in warmup_plan(xla) if s.cached]
    kernels = xla.derive(dataclasses.replace(config, attention_impl="pallas"))
    assert kernels.context_pages(8) == kernels.context_pages(96) == kernels.max_pages
    plan = warmup_plan(kernels)
    admits = [s for s in plan if s.phase == "admit" and not s.cached]
    cached = [s for s in plan if s.cached]
    assert cached == [dataclasses.replace(s, cached=True) for s in admits]
    assert max(map(plan.index, admits)) < min(map(plan.index, cached))
    assert [s for s in plan if s.phase == "write"] == [Shape("write", 1, 16, 1), Shape("write", 1, 16, 2)]
    assert not [s for s in first_request_shapes(kernels, plan, 32, 64) if s.cached]
    first, rest = staged_plan(kernels, plan, 32, 8)
    assert rest.index(Shape("admit", 1, 16, 1, cached=True)) < rest.index(Shape("admit", 2, 16, 2))


def test_a_paged_warmup_holds_one_set_of_pools(target):
    """The pools may take most of the device's memory: the warm-up allocates them once (its states of other
    row counts take them over), and between its shapes no more than them and the weights are alive."""
    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=64, page_size=8, num_pages=2048,
                                               prompt_buckets=(16,)))
    made, allocate = [], engine.empty_state
    engine.empty_state = lambda rows: made.append(rows) or allocate(rows)
    pool = engine.page_bytes() * engine.num_pages

    def live_bytes() -> int:  # every array of the process: the weights, and any an earlier test left
        return sum(a.nbytes for a in jax.live_arrays())

    gc.collect()
    before = live_bytes()
    peak = [before]

    def measure(index, shape):
        peak[0] = max(peak[0], live_bytes())

    plan = warmup_plan(engine)
    assert len({s.rows for s in plan if s.phase == "decode"}) == 2
    assert run_warmup(engine, plan, on_shape=measure) == len(plan)
    assert made == [1]
    assert peak[0] - before < 1.5 * pool, (peak[0], before, pool)


@pytest.mark.slow
def test_after_a_paged_kernel_warmup_prefix_hits_and_chunks_compile_nothing(target):
    """A paged engine with the kernels (interpreted here): requests whose prompts share prefixes of several
    lengths, ending inside a page or not, with rests of both buckets, alone and two at once, and a prompt
    prefilled in chunks, compile nothing after the warm-up, and generate what the contiguous engine does."""
    config = EngineConfig(max_batch_size=2, max_length=96, steps_per_sync=4, prompt_buckets=(16, 64), page_size=8,
                          prefill_chunk=16, attention_impl="pallas")
    engine = Engine(target, None, config)
    _serve_warmup(engine, [])
    rs = np.random.RandomState(7)
    shared = rs.randint(0, 95, 60).tolist()
    prompts = [shared[:20] + rs.randint(0, 95, 5).tolist(), shared[:44] + rs.randint(0, 95, 3).tolist(),
               shared[:37] + rs.randint(0, 95, 20).tolist(), shared, shared[:12] + rs.randint(0, 95, 30).tolist()]
    batcher = ContinuousBatcher(engine)
    first = batcher.submit(shared, 4)  # its pages cached for the others
    batcher.run()
    with _compilations() as compiles:
        lone = [batcher.submit(prompts[0], 6)]
        batcher.run()
        lone.append(batcher.submit(prompts[1], 6))
        batcher.run()
        pair = [batcher.submit(p, 6) for p in prompts[2:4]]
        batcher.run()
        chunked = batcher.submit(prompts[4], 6)  # 42 tokens, 12 cached: its rest in chunks of 16
        batcher.run()
    assert compiles == []
    assert min(g.cached_tokens for g in lone + pair) > 0
    want = Engine(target, None, dataclasses.replace(config, page_size=0, prefill_chunk=0, attention_impl="xla"))
    for g, p in zip(lone + pair + [chunked], prompts):
        assert g.result.output_ids == want.generate([p], 6)[0].output_ids
    assert first.result is not None and batcher.pages.all_free()


@pytest.mark.slow
def test_after_a_paged_warmup_three_choices_of_a_prompt_compile_nothing(target):
    """A paged engine: the choices' prefill of their prompt (nothing cached) beside the batch's state,
    their admission into its pages, the page tables as they grow and the state shrinking back to one
    row when they end were all compiled by the warm-up."""
    engine = Engine(target, None, EngineConfig(max_batch_size=4, max_length=48, steps_per_sync=4,
                                               prompt_buckets=(32,), page_size=8))  # rows that fit it grow pages
    params = [SamplingParams(temperature=1.0, seed=s) for s in (1, 2, 3)]
    _serve_warmup(engine, ["sample", "sample+logprobs"])
    prompt = np.random.RandomState(6).randint(0, 95, 11).tolist()
    batcher = ContinuousBatcher(engine)
    with _compilations() as compiles:
        lone = batcher.submit(prompt[:4], 20)  # a lone row first: the choices join it, the state grows to 4 rows
        batcher.step()
        choices = [batcher.submit(prompt, 20, sampling=p) for p in params]
        batcher.run()
        logged = batcher.submit(prompt[2:], 8, sampling=SamplingParams(temperature=0.7, seed=4, logprobs=0))
        batcher.run()
    assert compiles == []
    assert engine.prefilled_prompts == 3 and len({tuple(g.result.output_ids) for g in choices}) == 3
    assert len(logged.result.logprobs) == 8 and all(lp <= 0 for lp in logged.result.logprobs)
    assert len(lone.result.output_ids) == 20 and batcher.pages.all_free()


def test_warmup_stops_short_of_the_memory_mappings_linux_allows(target, monkeypatch, caplog):
    """XLA:CPU maps each compiled program's kernels into the process; past ``vm.max_map_count`` the next
    compile fails and takes the process down. The warm-up stops before the cap, saying why and how to
    raise it, and leaves the rest to the requests."""
    import dflash_jax.runtime.warmup as warmup

    engine = Engine(target, None, EngineConfig(max_batch_size=2, max_length=48, steps_per_sync=4, prompt_buckets=(16,)))
    plan = warmup_plan(engine)
    used = iter([100, 200, 80_000])
    monkeypatch.setattr(warmup, "memory_mappings", lambda: (next(used), 100_000))
    with caplog.at_level("WARNING", logger="dflash_jax.runtime.warmup"):
        assert run_warmup(engine, plan) == 2
    assert "vm.max_map_count" in caplog.text and f"the {len(plan) - 2} shapes left" in caplog.text


def test_memory_mappings_reads_the_process_and_the_cap():
    from dflash_jax.runtime.warmup import memory_mappings

    mappings = memory_mappings()
    if mappings is None:
        pytest.skip("no /proc (not Linux)")
    used, cap = mappings
    assert 0 < used < cap


def test_one_first_token_draw_serves_every_prompt_bucket(target):
    """A sampled prefill draws its first tokens with a program of the rows' shapes only: prompts of two
    buckets compile two prefills but one draw."""
    engine = Engine(target, None, EngineConfig(max_batch_size=1, max_length=100, prompt_buckets=(16, 64)))
    sampled = [SamplingParams(temperature=0.8, seed=1)]
    with _compilations() as compiles:
        engine.prefill([[3, 1, 4]], [4], [()], sampled)
    assert len(compiles) == 2  # the 16-token bucket's prefill and the draw
    with _compilations() as compiles:
        engine.prefill([[5] * 40], [4], [()], sampled)
    assert len(compiles) == 1  # the 64-token bucket's prefill; its draw is the 16-token one's
