"""The ingress's Prometheus metrics."""

from __future__ import annotations


def test_metrics_split_time_to_first_token_between_serve_and_the_engine() -> None:
    from cluster.metrics import Metrics
    from worker.outputs import RequestMetrics

    metrics = Metrics("m", "ing-1")
    metrics.observe_choice(0.30, None, 0.5, 1)  # at the ingress
    metrics.observe_engine(
        RequestMetrics(
            queue_time=0.01, time_to_first_token=0.25, time_per_output_token=0.0, e2e_latency=0.4
        )
    )
    text = metrics.render([]).decode()

    def total(name: str) -> float:
        return float(
            next(x for x in text.splitlines() if x.startswith(f"{name}_sum{{")).split()[-1]
        )

    assert total("kvray:time_to_first_token_seconds") == 0.30
    assert total("kvray:engine_time_to_first_token_seconds") == 0.25
    assert total("kvray:request_queue_time_seconds") == 0.01
