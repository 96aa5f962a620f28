"""A bounded load through the scheduler on a paged engine: clients sharing system prompts, every request
answered with its solo run's tokens, prefix hits counted, and every page back at the end."""

import random
import threading

import numpy as np
import pytest

from dflash_jax import Engine, EngineConfig, load_drafter, load_target
from dflash_jax.serving.scheduler import Scheduler
from copycat_fixtures import shallow_copycat_pair

CONFIG = dict(max_batch_size=4, max_length=96, steps_per_sync=4, prompt_buckets=(64,))


@pytest.mark.slow
def test_clients_sharing_system_prompts_get_their_solo_tokens_and_leak_no_pages(tmp_path):
    target_dir, drafter_dir = shallow_copycat_pair(tmp_path, block_size=8)
    target, drafter = load_target(target_dir), load_drafter(drafter_dir)
    paged = Engine(target, drafter, EngineConfig(page_size=8, num_pages=40, **CONFIG))
    rs = np.random.RandomState(3)
    systems = [rs.randint(0, 95, 24).tolist(), rs.randint(0, 95, 17).tolist()]
    prompts = [systems[i % 2] + rs.randint(0, 95, int(rs.randint(1, 30))).tolist() for i in range(12)]
    max_new = [int(rs.randint(4, 30)) for _ in prompts]

    scheduler = Scheduler(paged).start()
    outputs: dict[int, list[int]] = {}
    done = threading.Event()

    def client(i: int) -> None:
        tokens: list[int] = []

        def sink(kind, payload):
            if kind == "tokens":
                tokens.extend(payload)
            else:
                assert kind == "done", payload
                outputs[i] = tokens
                if len(outputs) == len(prompts):
                    done.set()

        threading.Event().wait(random.Random(i).uniform(0, 0.5))
        scheduler.submit(prompts[i], max_new[i], sink, stop_token_ids=[11])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert done.wait(600)
    scheduler.close()
    pages = scheduler.metrics.pages
    assert pages.in_use == 0 and pages.prefix_hits > 0
    text = scheduler.metrics.render("m")
    assert 'dflash_kv_pages_in_use{model="m"} 0' in text and "dflash_prefix_cache_hits_total" in text

    contiguous = Engine(target, drafter, EngineConfig(**CONFIG))
    for i, prompt in enumerate(prompts):
        assert outputs[i] == contiguous.generate([prompt], max_new[i], [11])[0].output_ids, i
