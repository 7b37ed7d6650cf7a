"""The KV- and queue-driven autoscaling policy."""

from __future__ import annotations

from ray.serve.config import AutoscalingContext

from cluster.autoscaling import EngineLoadPolicy


def context(
    requests: dict[str, float], kv: dict[str, float], current: int = 2
) -> AutoscalingContext:
    metrics = {"engine_requests": requests, "kv_usage": kv} if requests else {}
    return AutoscalingContext(
        deployment_id=None,
        deployment_name="w",
        app_name="kvray",
        current_num_replicas=current,
        target_num_replicas=current,
        running_replicas=[],
        total_num_requests=0.0,
        total_queued_requests=0.0,
        aggregated_metrics=metrics,
        raw_metrics=None,
        capacity_adjusted_min_replicas=1,
        capacity_adjusted_max_replicas=8,
        policy_state={},
        last_scale_up_time=None,
        last_scale_down_time=None,
        current_time=0.0,
        config=None,
    )


def test_policy_scales_with_engine_requests_and_kv_pressure() -> None:
    policy = EngineLoadPolicy(target_requests=8, target_kv_usage=0.9)
    assert policy(context({"a": 20, "b": 12}, {"a": 0.2, "b": 0.3}))[0] == 4
    assert policy(context({"a": 1, "b": 1}, {"a": 0.95, "b": 0.97}))[0] == 3
    assert policy(context({"a": 0, "b": 0}, {"a": 0.0, "b": 0.0}))[0] == 0
    assert policy(context({}, {}, current=3))[0] == 3
