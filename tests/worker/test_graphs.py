"""Graph bucket sizes (CPU); capture and replay run on the GPU (tests/gpu)."""

from worker.graphs import prompt_graph_buckets


def test_prompt_graph_buckets_cover_every_step_size_with_bounded_padding():
    buckets = prompt_graph_buckets(2048)
    assert (
        buckets[:4] == [8, 16, 32, 64] and buckets[-1] == 2048 and buckets == sorted(set(buckets))
    )
    for tokens in range(1, 2049):
        bucket = next(b for b in buckets if b >= tokens)
        assert bucket - tokens < (32 if tokens <= 512 else 128)
    assert prompt_graph_buckets(100)[-1] == 100 and prompt_graph_buckets(5) == [5]
