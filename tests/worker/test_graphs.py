"""Graph bucket sizes and the capture's collector guard (CPU); capture and replay run on
the GPU (tests/gpu)."""

import gc
import weakref

from worker.graphs import _no_collection, prompt_graph_buckets


def test_prompt_graph_buckets_cover_every_step_size_with_bounded_padding():
    buckets = prompt_graph_buckets(2048)
    assert (
        buckets[:4] == [8, 16, 32, 64] and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    )
    for tokens in range(1, 2049):
        bucket = next(b for b in buckets if b >= tokens)
        assert bucket - tokens < (32 if tokens <= 512 else 128)
    assert prompt_graph_buckets(100)[-1] == 100 and prompt_graph_buckets(5) == [5]


def test_captures_run_with_the_cycle_collector_off_after_one_collection():
    class Cycle:
        def __init__(self) -> None:
            self.me = self

    assert gc.isenabled()
    dropped = weakref.ref(Cycle())  # garbage only the collector frees, as an engine's graphs
    with _no_collection():
        assert not gc.isenabled() and dropped() is None
    assert gc.isenabled()
    gc.disable()
    try:
        with _no_collection():
            pass
        assert not gc.isenabled()  # a caller's own setting is kept
    finally:
        gc.enable()
