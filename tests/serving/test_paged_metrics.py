"""``/metrics`` reports a paged engine's pages, prefix-cache hits and preemptions."""

import dataclasses

from dflash_jax.runtime.pages import PageAllocator
from dflash_jax.serving.metrics import Metrics


def test_metrics_render_page_use_and_prefix_hits():
    metrics = Metrics()
    assert "dflash_kv_pages" not in metrics.render("m")  # a contiguous engine has none
    pages = PageAllocator(num_pages=9, page_size=2)
    first = pages.allocate([1, 2, 3, 4, 5], positions=6)
    pages.register([1, 2, 3, 4, 5], first.pages)
    pages.release(first.pages)
    held = pages.allocate([1, 2, 3, 4, 9], positions=8)  # 2 pages cached, 2 fresh
    metrics.pages = dataclasses.replace(pages.stats(), preemptions=3)
    text = metrics.render("m")
    for line in ('dflash_kv_pages_total{model="m"} 8', 'dflash_kv_pages_in_use{model="m"} 4',
                 'dflash_kv_pages_cached{model="m"} 0', 'dflash_prefix_cache_queries_total{model="m"} 10',
                 'dflash_prefix_cache_hits_total{model="m"} 4', 'dflash_preemptions_total{model="m"} 3'):
        assert line in text, line
    pages.release(held.pages)
    assert pages.all_free()
