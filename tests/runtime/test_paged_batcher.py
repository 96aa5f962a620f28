"""The batcher's page accounting on a host-only paged engine (``FakePagedEngine``: no device work): how
many rows a pool admits against contiguous caches of the same memory, and how often a request may be
paused for pages."""

import numpy as np
import pytest

from dflash_jax.runtime.batcher import ContinuousBatcher
from dflash_jax.serving.testing import FakeEngine, FakePagedEngine, live_rows

VOCAB = 512


def mixed_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts of 100-8,000 tokens, uniformly."""
    rs = np.random.RandomState(seed)
    return [rs.randint(0, VOCAB, int(rs.randint(100, 8001))).tolist() for _ in range(n)]


def test_a_pool_runs_twice_the_rows_of_contiguous_caches_in_the_same_memory():
    """Prompts of 100-8,000 tokens and 256 new tokens each on an engine of 16k-token contexts: the memory
    of 4 contiguous rows, as pages, runs > 2x as many requests at once, by the batcher's own admission
    (pages for the context and one call, more as rows grow, the newest paused when the pool is short)."""
    budget_rows, max_length, page = 4, 16384, 16
    prompts = mixed_prompts(30 * budget_rows)
    common = dict(max_length=max_length, block_size=16, steps_per_sync=4)
    contiguous = live_rows(FakeEngine(VOCAB, max_batch_size=budget_rows, **common), prompts, 256)
    paged = live_rows(FakePagedEngine(VOCAB, page_size=page, num_pages=budget_rows * max_length // page,
                                      prefix_cache=False, max_batch_size=64, **common), prompts, 256)
    assert contiguous["most"] == budget_rows
    assert paged["first"] >= 2 * budget_rows and paged["mean"] >= 2 * contiguous["mean"], (paged, contiguous)


def _pauses(news: list[int], pages: int, **config) -> list[int]:
    engine = FakePagedEngine(VOCAB, page_size=4, num_pages=pages, max_batch_size=8, max_length=256, block_size=4,
                             steps_per_sync=1, **config)
    batcher = ContinuousBatcher(engine)
    generations = [batcher.submit([7 + i, 3, 5, 9], n) for i, n in enumerate(news)]
    batcher.run()
    for g in generations:
        assert g.error is None, g.error
        assert g.result.output_ids == engine.reference(g.prompt_ids, n := g.max_len - len(g.prompt_ids)), n
    assert batcher.pages.all_free()
    return [g.preemptions for g in generations]


@pytest.mark.parametrize("news", [[100] * 8, [40, 60, 80, 100, 120, 140, 160, 180]])
def test_a_request_is_paused_at_most_max_preemptions_times(news):
    """Eight requests that each take 26-46 of the pool's 40-60 pages: without a bound, the newest rows are
    paused again at every resumption while older ones grow (4 times here); with ``max_preemptions`` a
    request paused that often resumes with pages for its whole length and runs to its end."""
    pages = 40 if news[0] == news[-1] else 60
    unbounded = _pauses(news, pages, max_preemptions=1000)
    assert max(unbounded) >= 4
    for bound in (2, 1):
        paused = _pauses(news, pages, max_preemptions=bound)
        assert max(paused) == bound and sum(paused) < sum(unbounded)
    assert _pauses(news, pages, max_preemptions=0) == [0] * len(news)  # every request has its whole length


def test_the_fake_paged_engine_refuses_a_row_past_its_pages():
    """The check that the tests above rely on: a row committing a position beyond its pages raises."""
    engine = FakePagedEngine(VOCAB, page_size=4, num_pages=8, max_batch_size=1, max_length=64, block_size=4,
                             steps_per_sync=4)
    state = engine.empty_state(1)
    state, rows, _, admission = engine.prefill_paged(state, [[1, 2, 3]], [40], [()], [[1]], [0])
    state = engine.admit_paged(state, rows, [0], admission)
    with pytest.raises(RuntimeError, match="past its 1 pages"):
        engine.decode(state, 4)


@pytest.mark.parametrize("seed", [137, 154, 276, 392, 7])
def test_every_request_finishes_with_chunked_prompts_preemption_and_whole_length_rows(seed):
    """Random workloads over a tight pool with chunked prefill and every ``max_preemptions``: each request
    finishes with its own tokens and every page comes back. A row paused while another prompt is prefilled
    in chunks queues behind that prompt, which keeps its pages: queued before it, the row could wait for
    those pages while the prompt waited for its turn (these seeds would stall so)."""
    rs = np.random.RandomState(seed)
    engine = FakePagedEngine(VOCAB, page_size=4, num_pages=int(rs.randint(56, 90)), max_batch_size=4, max_length=256,
                             block_size=4, steps_per_sync=int(rs.randint(1, 3)), prefill_chunk=8,
                             max_preemptions=int(rs.randint(0, 3)))
    batcher = ContinuousBatcher(engine)
    generations = [batcher.submit(rs.randint(0, 500, int(rs.randint(4, 120))).tolist(), int(rs.randint(10, 100)))
                   for _ in range(10)]
    for _ in range(5000):
        if batcher.idle:
            break
        batcher.step()
    assert batcher.idle, [(g.preemptions, len(g.pages), g.finished) for g in generations]
    for g in generations:
        assert g.error is None, g.error
        assert g.result.output_ids == engine.reference(g.prompt_ids, g.max_len - len(g.prompt_ids))
    assert batcher.pages.all_free()
