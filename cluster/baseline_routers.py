"""Two baseline policies for the worker deployment, to set kvray's router against
(`advanced.router.policy`; `kvray bench cluster --scenarios prefix` runs each).

- `PowerOfTwoRouter`: Serve's default procedure. Two replicas drawn at random form one
  rank, and Serve takes the one with fewer ongoing calls (its queue-length probe, cached
  for a moment). Serve's own default router adds a same-node preference and model
  multiplexing, which kvray does not use; it is private API (`ray.serve._private`), so this
  is written against the public `RequestRouter`. For kvray, ongoing calls are the open
  sessions and the submits in flight, not the engine's requests: the choice is close to
  random, which is what Serve's default gives kvray's calls.
- `RoundRobinRouter`: each replica in turn, in the order of their ids; the replicas after
  the chosen one follow as fallbacks (Serve moves on when a replica's queue is full).

Neither reads prompts or reports; calls that name a replica go there (`KvrayRouter`).
"""

from __future__ import annotations

import random
from typing import Any

from ray.serve.request_router import PendingRequest, RunningReplica

from cluster.router import KvrayRouter, RouteHint


class PowerOfTwoRouter(KvrayRouter):
    """Of two random replicas, the one Serve finds with fewer ongoing calls."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._rng = random.Random()

    def rank(
        self,
        candidates: list[RunningReplica],
        hint: RouteHint | None,
        pending_request: PendingRequest | None,
    ) -> list[list[RunningReplica]]:
        # Serve takes the first of a rank on a tie (as it is at idle, or with one session
        # open on each): the order must be random too, or one replica takes every tie.
        return [self._rng.sample(candidates, min(2, len(candidates)))]


class RoundRobinRouter(KvrayRouter):
    """Each call to the next replica in id order; the rest follow as fallbacks."""

    def initialize_state(self, **kwargs: Any) -> None:
        self._turn = 0

    def rank(
        self,
        candidates: list[RunningReplica],
        hint: RouteHint | None,
        pending_request: PendingRequest | None,
    ) -> list[list[RunningReplica]]:
        if not candidates:
            return []
        ordered = sorted(candidates, key=lambda r: r.replica_id.unique_id)
        first = self._turn % len(ordered)
        self._turn += 1
        return [[r] for r in ordered[first:] + ordered[:first]]
