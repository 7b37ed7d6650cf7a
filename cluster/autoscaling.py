"""Autoscaling policy of the worker deployment: engine queue depth and KV usage.

Serve's default policy counts ongoing *calls*; a kvray call can carry a batch of requests,
and a replica whose KV cache is full is saturated whatever its call count. So each worker
replica reports `engine_requests` (running + waiting) and `kv_usage` through
`record_autoscaling_stats`, and this policy asks for enough replicas to bring requests per
replica to the target, plus one while the mean KV usage is above its target. Serve applies
min/max replicas and the up/down-scale delays of the AutoscalingConfig around it.

Serve pickles this module by value into its controller: keep it free of kvray imports.
"""

from __future__ import annotations

from typing import Any

from ray.serve.config import AutoscalingContext

POLICY_PATH = "cluster.autoscaling:EngineLoadPolicy"


class EngineLoadPolicy:
    """Callable policy: `(ctx) -> (desired replicas, policy state)`."""

    def __init__(self, target_requests: float = 16.0, target_kv_usage: float = 0.9):
        self.target_requests = target_requests
        self.target_kv_usage = target_kv_usage

    def __call__(self, ctx: AutoscalingContext) -> tuple[float, dict[str, Any]]:
        metrics = ctx.aggregated_metrics or {}
        requests = metrics.get("engine_requests") or {}
        kv_usage = metrics.get("kv_usage") or {}
        if not requests:  # no replica has reported yet: keep what Serve decided so far
            return float(ctx.target_num_replicas), {}
        desired = sum(requests.values()) / self.target_requests
        if kv_usage and sum(kv_usage.values()) / len(kv_usage) > self.target_kv_usage:
            desired = max(desired, ctx.current_num_replicas + 1)
        return desired, {}
