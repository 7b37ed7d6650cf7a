"""Replica choice for worker calls: prefix affinity first, then load.

`PrefixLoadRouter` is a Ray Serve `RequestRouter` (public API, `ray.serve.request_router`)
installed on the worker deployment, so it runs inside every handle that calls workers,
that is inside each ingress replica. Every call carries a `RouteHint` as its first
argument: the chained page hashes of each prompt (the same hash the worker's prefix cache
uses), the number of requests and tokens, or a target replica for control calls (session,
abort). `KvrayRouter` sends those to their replica whatever the policy; it is the base of
this policy and of the baselines in `baseline_routers.py` (`advanced.router.policy`).

A replica that reports its engine stuck in one step for more than `stalled_after_s` ranks
last (its requests would wait for the stall timeout), until it reports progress again.

Replicas report `routing_stats` (load and their prefix-cache keys) every
`stats_period_s` through `record_routing_stats`, with how many requests each sender (an
ingress: RouteHint.sender) has had answered there. The router adds the requests it sent to
a replica and that the replica had not yet answered at its report, so a burst of calls does
not all land on the replica that looked idle half a second ago. (It counted calls sent after
the report's time instead; but a busy worker takes a while to run a call it was sent, and a
report taken meanwhile dropped those calls from its load, and a burst went mostly to one
replica.) A prefix it sent somewhere counts as
cached there for `memory_s`, reported or not: a report taken while that call still waited
or ran its prompt lacks the prefix's pages, and must not undo the claim (it did, and two
requests in a row with one long prefix could go to different replicas).

Ranking (`rank_replicas`): a replica is overloaded when its load exceeds the least loaded
one's by more than `imbalance_threshold` requests *and* by more than `imbalance_ratio` times.
The others are ordered by matched prefix pages, then, among those within one request (or
10 %) of the least load, by how full their caches are (in sixteenths, all of 15/16 and above
counting as full), then load; the overloaded follow by load.
So affinity decides while the cluster is roughly balanced (at 60 vs 70 running requests a
prefix still goes where it is cached), and one hot prefix cannot pile onto one replica.
A prefix that no replica holds goes where the cache has the most room, as SGLang's
cache-aware router sends it to the smallest tree: where it lands is where its next requests
follow it, so new prefixes placed by the load of the moment (one request more or less) could
put three tenants' contexts on one replica and one on the other, and the three evict each
other while half the other cache sits empty. Fullness counts the pages a replica reports
(`resident_pages`: cached, or of prompts it accepted in the last 10 s) and those of the
requests this router sent it that the report had not answered. Once every cache is full
(the steady state) load decides again, as it does for calls whose prompts fill no page
(they place nothing in the cache): a replica with more room must not draw every short
request (it did, up to the imbalance threshold, until the slack and that exception).
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Container, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica

# `advanced.router.policy` -> the RequestRouter class of the worker deployment
ROUTER_CLASS_PATHS = {
    "prefix_load": "cluster.router:PrefixLoadRouter",
    "power_of_two": "cluster.baseline_routers:PowerOfTwoRouter",
    "round_robin": "cluster.baseline_routers:RoundRobinRouter",
}
STALLED_LOAD = 1e9  # the load a replica stuck in a step is ranked with
FULLNESS_STEPS = 16  # caches whose fullness differs by less than this share rank alike
# cache room decides among replicas at most this far above the least load (requests, share)
FULLNESS_SLACK, FULLNESS_SLACK_RATIO = 1.0, 0.1


@dataclass(frozen=True, slots=True)
class RouteHint:
    """What the router needs to know about one call; the first argument of every worker call."""

    page_hashes: tuple[tuple[int, ...], ...] = ()  # per distinct prompt of the call
    num_requests: int = 0
    num_tokens: int = 0
    replica_id: str | None = None  # control calls: route to exactly this replica
    sender: str = ""  # the calling ingress; replicas count the requests they answered per sender


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """One replica as the policy sees it: load, cached prefix keys, and the share of its KV
    cache that holds prefixes (`fullness`, 0..1)."""

    replica_id: str
    load: float
    kv_usage: float = 0.0
    keys: Container[int] = frozenset()
    fullness: float = 0.0


def matched_pages(page_hashes: Sequence[int], keys: Container[int]) -> int:
    """Leading pages of one prompt found in a replica's prefix cache."""
    n = 0
    for key in page_hashes:
        if key not in keys:
            break
        n += 1
    return n


def rank_replicas(
    hint: RouteHint | None,
    views: Sequence[ReplicaView],
    imbalance_threshold: float,
    imbalance_ratio: float = 1.0,
) -> list[str]:
    """Replica ids, best first (see the module docstring)."""
    if not views:
        return []
    order = list(views)
    random.shuffle(order)  # ties go to a random replica, not always the first
    least = min(v.load for v in order)
    prompts = hint.page_hashes if hint else ()

    def affinity(v: ReplicaView) -> int:
        return sum(matched_pages(p, v.keys) for p in prompts)

    def overloaded_(v: ReplicaView) -> bool:
        return v.load > least + imbalance_threshold and v.load > least * imbalance_ratio

    # cache room decides only for a call with pages to place, among replicas within slack
    # of the least load
    within = least + max(FULLNESS_SLACK, FULLNESS_SLACK_RATIO * least) if any(prompts) else -1.0

    def room(v: ReplicaView) -> int:
        """How full the cache is, in steps; FULLNESS_STEPS where it may not decide."""
        if v.load > within:
            return FULLNESS_STEPS
        return min(int(v.fullness * FULLNESS_STEPS), FULLNESS_STEPS - 1)

    balanced = [v for v in order if not overloaded_(v)]
    overloaded = [v for v in order if overloaded_(v)]
    balanced.sort(key=lambda v: (-affinity(v), room(v), v.load, v.kv_usage))
    overloaded.sort(key=lambda v: (v.load, v.kv_usage))
    return [v.replica_id for v in balanced + overloaded]


@dataclass(slots=True)
class _Sent:
    """A call this router sent to a replica in the last `memory_s`."""

    at: float
    num_requests: int
    num_pages: int = 0


@dataclass(slots=True)
class _ReplicaMemory:
    sent: deque[_Sent] = field(default_factory=deque)
    sent_total: dict[str, int] = field(default_factory=dict)  # requests sent, per sender
    stats_time: float = -1.0
    reported_keys: frozenset[int] = frozenset()
    # page key -> until when it counts as cached
    claimed: dict[int, float] = field(default_factory=dict)
    pruned_at: float = 0.0


@dataclass(frozen=True, slots=True)
class _KnownKeys:
    """A replica's prefix keys as the router knows them: reported, or claimed by a recent call."""

    reported: frozenset[int]
    claimed: dict[int, float]
    now: float

    def __contains__(self, key: object) -> bool:
        return key in self.reported or self.claimed.get(key, 0.0) > self.now  # type: ignore[call-overload]


def _unanswered(memory: _ReplicaMemory, answered: Mapping[str, int]) -> int:
    """Requests this router sent to the replica that its last report had not answered. At
    most those sent in the last `memory_s`: a call lost on the way, or a count the replica
    does not report (its sender idle for long), must not weigh on the replica for ever."""
    unanswered = sum(max(0, n - answered.get(sender, 0)) for sender, n in memory.sent_total.items())
    return min(unanswered, sum(s.num_requests for s in memory.sent))


def _unanswered_pages(sent: deque[_Sent], unanswered: int) -> int:
    """Prompt pages of the last `unanswered` requests sent: those a report had not accepted,
    so its `resident_pages` lacks them (a report's time says nothing of that: one taken after
    a call was sent may still predate its acceptance)."""
    pages = 0
    for s in reversed(sent):
        if unanswered <= 0:
            break
        pages, unanswered = pages + s.num_pages, unanswered - s.num_requests
    return pages


def _hint_of(pending_request: PendingRequest | None) -> RouteHint | None:
    """The call's RouteHint. Duck-typed on purpose: Serve may load this module by value
    (cloudpickle), and then the caller's RouteHint class is not this module's class."""
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if hasattr(first, "page_hashes") and hasattr(first, "replica_id") else None


class KvrayRouter(RequestRouter):
    """What every router of the worker deployment does: a call whose hint names a replica
    (`session`, `abort`) goes to that replica only; the policy (`rank`) places the others."""

    async def choose_replicas(
        self,
        candidate_replicas: list[RunningReplica],
        pending_request: PendingRequest | None = None,
    ) -> list[list[RunningReplica]]:
        hint = _hint_of(pending_request)
        if hint is not None and hint.replica_id is not None:
            target = [r for r in candidate_replicas if r.replica_id.unique_id == hint.replica_id]
            # A control call for a replica that is gone has nothing left to act on anywhere.
            return [target] if target else [candidate_replicas]
        return self.rank(candidate_replicas, hint, pending_request)

    def rank(
        self,
        candidates: list[RunningReplica],
        hint: RouteHint | None,
        pending_request: PendingRequest | None,
    ) -> list[list[RunningReplica]]:
        """Serve's ranks for one call: it tries each rank in turn and, within one, takes the
        replica with the fewest ongoing calls whose queue is not full."""
        raise NotImplementedError


class PrefixLoadRouter(KvrayRouter):
    """Serve request router for WorkerDeployment: affinity + load (see module docstring)."""

    def initialize_state(
        self,
        imbalance_threshold: float = 8.0,
        imbalance_ratio: float = 1.0,
        stalled_after_s: float = 5.0,
        memory_s: float = 10.0,
        **kwargs: Any,
    ) -> None:
        """`memory_s`: forget a sent call after this long even if its replica never reports."""
        self._imbalance_threshold = imbalance_threshold
        self._imbalance_ratio = imbalance_ratio
        self._stalled_after_s = stalled_after_s
        self._memory_s = memory_s
        self._memory: dict[ReplicaID, _ReplicaMemory] = {}
        self._recorded: deque[Any] = deque(maxlen=1024)

    def rank(
        self,
        candidates: list[RunningReplica],
        hint: RouteHint | None,
        pending_request: PendingRequest | None,
    ) -> list[list[RunningReplica]]:
        self._forget_gone(candidates)
        by_id = {r.replica_id.unique_id: r for r in candidates}
        views = [self._view(r) for r in candidates]
        ranked = rank_replicas(hint, views, self._imbalance_threshold, self._imbalance_ratio)
        if ranked and hint is not None and hint.num_requests and pending_request is not None:
            self._remember(pending_request, by_id[ranked[0]], hint)
        return [[by_id[rid]] for rid in ranked]

    def _remember(
        self, pending_request: PendingRequest, replica: RunningReplica, hint: RouteHint
    ) -> None:
        """Count a call against the replica it will most likely go to (the first rank; the
        base router takes it unless its queue is full) until the replica's next report.
        Serve calls `on_request_routed` only in strict mode, so the policy records itself."""
        request_id = getattr(pending_request.metadata, "internal_request_id", id(pending_request))
        if request_id in self._recorded:
            return  # a retry of the same request: counted already
        self._recorded.append(request_id)
        now = time.time()
        memory = self._memory.setdefault(replica.replica_id, _ReplicaMemory())
        pages = sum(len(prompt) for prompt in hint.page_hashes)
        memory.sent.append(_Sent(now, hint.num_requests, pages))
        memory.sent_total[hint.sender] = memory.sent_total.get(hint.sender, 0) + hint.num_requests
        until = now + self._memory_s
        for prompt in hint.page_hashes:
            memory.claimed.update(dict.fromkeys(prompt, until))

    def _forget_gone(self, candidates: list[RunningReplica]) -> None:
        if len(self._memory) > len(candidates):
            alive = {r.replica_id for r in candidates}
            self._memory = {rid: m for rid, m in self._memory.items() if rid in alive}

    def _view(self, replica: RunningReplica) -> ReplicaView:
        stats: Mapping[str, Any] = replica.routing_stats or {}
        memory = self._memory.setdefault(replica.replica_id, _ReplicaMemory())
        stats_time = float(stats.get("time", -1.0))
        if stats_time != memory.stats_time:
            memory.stats_time = stats_time
            memory.reported_keys = frozenset(stats.get("prefix_keys", ()))
        now = time.time()
        while memory.sent and memory.sent[0].at <= now - self._memory_s:
            memory.sent.popleft()
        if now - memory.pruned_at > self._memory_s:  # drop expired claims now and then
            memory.claimed = {k: t for k, t in memory.claimed.items() if t > now}
            memory.pruned_at = now
        keys: Container[int] = memory.reported_keys
        if memory.claimed:
            keys = _KnownKeys(memory.reported_keys, memory.claimed, now)
        reported_load = float(stats.get("num_running", 0)) + float(stats.get("num_waiting", 0))
        unanswered = _unanswered(memory, stats.get("answered") or {})
        load = reported_load + unanswered
        if float(stats.get("stalled_s", 0.0)) > self._stalled_after_s:
            load = STALLED_LOAD  # stuck in a step: ranked last until it reports progress
        total_pages = float(stats.get("num_total_pages", 0))
        fullness = 0.0
        if total_pages:
            resident = float(stats.get("resident_pages", 0))
            fullness = (resident + _unanswered_pages(memory.sent, unanswered)) / total_pages
        return ReplicaView(
            replica.replica_id.unique_id,
            load,
            float(stats.get("kv_usage", 0.0)),
            keys,
            fullness,
        )
