"""A bounded load on loopback: 64 HTTP clients against a server whose tiny engine has a paged cache (prefix
caching on, a pool small enough that rows are preempted), sending requests that share system prompts, with
varied lengths, for a fixed duration. Every request is answered with its solo run's tokens (the engine's,
each request alone), streamed or not, and every page is back in the pool at the end (``/metrics``)."""

from __future__ import annotations

import httpx
import numpy as np
import pytest
import tokenizer_fixtures as tf

from dflash_jax import Engine, EngineConfig, load_drafter, load_target
from dflash_jax.io.tokenizer import Tokenizer
from dflash_jax.serving import ServerThread, create_app
from dflash_jax.serving.testing import completion_ids, pages_back, run_clients

CLIENTS = 64
DURATION_S = 5.0  # clients send new requests until then; every request sent is answered
PAGE = 16
# A 128-token bucket: a resumed row's context (its prompt and output) may outgrow 64, and a request whose
# context could outgrow the largest bucket is never paused (it gets its whole length at admission).
CONFIG = dict(max_length=128, prompt_buckets=(64, 128), steps_per_sync=2)
# 8 usable pages: a request takes at most 7 alone (a 60-token prompt and 48 new tokens), so two rows
# run at once while short and the newer is paused when the older grows. Two rows, two prompt buckets and a
# few cached-prefix lengths keep the compiled programs few.
PAGED = dict(max_batch_size=2, page_size=PAGE, num_pages=8, prefix_cache=True, **CONFIG)


def workload(seed: int = 0) -> list[tuple[list[int], int]]:
    """30 requests: three system prompts (20, 27 and 35 tokens: a cached prefix ends inside a page) each
    with user turns of 1-25 tokens and 4-48 new tokens, some prompts repeated with another length; and six
    long answers to short prompts (64 new tokens: 6 pages each when done, so two of them running at once
    outgrow the pool and one is paused)."""
    rs = np.random.RandomState(seed)
    systems = [rs.randint(10, 500, n).tolist() for n in (20, 27, 35)]
    requests = []
    for i in range(24):
        user = rs.randint(10, 500, int(rs.randint(1, 26))).tolist()
        requests.append((systems[i % 3] + user, int(rs.choice([4, 8, 16, 32, 48]))))
    requests[-1] = (requests[0][0], 48 if requests[0][1] != 48 else 32)  # a prompt entirely cached
    requests += [(systems[0] + rs.randint(10, 500, int(rs.randint(1, 5))).tolist(), 64) for _ in range(6)]
    return requests


@pytest.mark.slow
def test_64_clients_sharing_system_prompts_get_their_solo_tokens_and_leak_no_pages(tmp_path):
    # a two-layer target and a one-layer drafter: the smallest programs
    target_dir, drafter_dir = tf.write_tiny_models_with_tokenizer(tmp_path, target_overrides={"num_layers": 2},
                                                                  drafter_overrides={"num_layers": 1})
    tokenizer = Tokenizer(target_dir)
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    requests = workload()
    stops = tokenizer.stop_token_ids
    # Each request alone, before the server shares the engine (tests/runtime/test_paged_engine.py shows
    # the paged engine's solo runs equal the contiguous engine's).
    engine = Engine(target, drafter, EngineConfig(**PAGED))
    solo = [engine.generate([p], m, stops)[0].output_ids for p, m in requests]
    app = create_app(engine, tokenizer, model_name="tiny", max_length=CONFIG["max_length"],
                     vocab_size=target.config.vocab_size)
    with ServerThread(app) as srv:
        with httpx.Client(base_url=srv.url, timeout=300) as client:
            assert completion_ids(client, *requests[0], streamed=False) == solo[0]
        answers, errors = run_clients(srv.url, requests, CLIENTS, DURATION_S)
        assert not errors, errors[:3]
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            metrics = pages_back(client)
    assert len(answers) >= CLIENTS  # every client's requests were answered (each sent at least one)
    for i, ids, _ in answers:
        assert ids == solo[i], (i, requests[i])
    assert metrics["dflash_kv_pages_in_use"] == 0 and metrics["dflash_kv_pages_total"] == PAGED["num_pages"]
    assert metrics["dflash_preemptions_total"] > 0 and metrics["dflash_prefix_cache_hits_total"] > 0
    assert app.state.ctx.scheduler._batcher.pages.all_free()
