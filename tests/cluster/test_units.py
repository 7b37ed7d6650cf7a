"""Fast checks of the cluster's pure parts: routing policy, wire format, config, protocol,
autoscaling policy. No Ray runtime is started here."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError
from ray.serve.config import AutoscalingContext

from cluster import config as cluster_config
from cluster.autoscaling import EngineLoadPolicy
from cluster.config import (
    API_KEYS_ENV,
    ClusterConfig,
    cgroup_cpu_limit,
    cores_text,
    usable_cores,
    worker_torch_threads,
)
from cluster.dispatch import CallError, Dispatcher, Group, GroupStream
from cluster.protocol import ChatCompletionRequest, CompletionRequest
from cluster.router import ReplicaView, RouteHint, matched_pages, rank_replicas
from cluster.transport import (
    Accepted,
    Refused,
    decode_deltas,
    decode_first,
    decode_requests,
    encode_accepted,
    encode_deltas,
    encode_refused,
    encode_requests,
)
from worker.config import EngineConfig
from worker.outputs import RequestDelta, RequestMetrics, TokenLogprobs
from worker.page_hash import page_hashes
from worker.sampling import SamplingParams
from worker.validation import EngineRequest

REPO = Path(__file__).resolve().parents[2]

PROMPT = list(range(100, 180))  # 5 full pages of 16
KEYS = page_hashes(PROMPT, 16)


# -- router policy -----------------------------------------------------------------------------


def test_matched_pages_counts_the_leading_run_only() -> None:
    assert matched_pages(KEYS, set(KEYS)) == 5
    assert matched_pages(KEYS, set(KEYS[:3])) == 3
    assert matched_pages(KEYS, set(KEYS[1:])) == 0


def test_affinity_wins_while_balanced() -> None:
    hint = RouteHint(page_hashes=(tuple(KEYS),), num_requests=1)
    views = [
        ReplicaView("cold", 0),
        ReplicaView("warm", 2, keys=set(KEYS[:4])),
        ReplicaView("luke", 1, keys={KEYS[0]}),
    ]
    assert rank_replicas(hint, views, imbalance_threshold=2) == ["warm", "luke", "cold"]


def test_load_wins_past_the_imbalance_threshold() -> None:
    hint = RouteHint(page_hashes=(tuple(KEYS),), num_requests=1)
    views = [ReplicaView("idle", 0), ReplicaView("hot", 9, keys=set(KEYS))]
    assert rank_replicas(hint, views, imbalance_threshold=8) == ["idle", "hot"]
    assert rank_replicas(hint, views, imbalance_threshold=9) == ["hot", "idle"]


def test_without_affinity_the_least_loaded_replica_goes_first() -> None:
    views = [
        ReplicaView("a", 3),
        ReplicaView("b", 1, kv_usage=0.9),
        ReplicaView("c", 1, kv_usage=0.1),
    ]
    assert rank_replicas(None, views, imbalance_threshold=8) == ["c", "b", "a"]
    assert rank_replicas(None, [], imbalance_threshold=8) == []


# -- wire format ---------------------------------------------------------------------------------


def test_requests_round_trip_through_msgpack() -> None:
    params = SamplingParams(temperature=0.5, stop=("x", "yz"), seed=3, logprobs=2, max_tokens=7)
    requests = [
        EngineRequest("r-0", [1, 2, 3], params),
        EngineRequest("r-1", [4], SamplingParams()),
    ]
    assert decode_requests(encode_requests(requests)) == requests


def test_first_frame_is_accept_or_refusal() -> None:
    assert decode_first(encode_accepted("abc")) == Accepted("abc")
    assert decode_first(encode_refused("full", "queue full")) == Refused("full", "queue full")


def test_deltas_round_trip_with_logprobs() -> None:
    deltas = [
        RequestDelta("a", [5], [TokenLogprobs(5, -0.25, {5: -0.25, 9: -2.0})], None, None, 12, 4),
        RequestDelta("b", [], None, "abort", None, 3, 0, RequestMetrics(0.5, 1.0, 0.25, 3.0, 1)),
        RequestDelta("c", [7, 8], None, "error", "boom", 0, 0),
    ]
    assert decode_deltas(encode_deltas(deltas)) == deltas


# -- config --------------------------------------------------------------------------------------


def test_config_from_yaml(tmp_path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "engine: {model: demo, num_pages: 64}\n"
        "autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}\n"
        "advanced: {router: {batch_window_ms: 0, imbalance_threshold: 3}}\n"
        "worker_resources: {num_gpus: 1, accelerator_a100: 0.1}\n"
    )
    config = ClusterConfig.from_yaml(path)
    assert config.engine.num_pages == 64 and config.advanced.router.batch_window_ms == 0
    assert config.autoscaling is not None and config.autoscaling.max_replicas == 4
    options = config.worker_ray_resources(cluster_has_gpus=False)
    assert options == {"num_cpus": 1.0, "num_gpus": 1, "resources": {"accelerator_a100": 0.1}}


def test_worker_gets_a_gpu_only_where_there_is_one() -> None:
    assert "num_gpus" not in ClusterConfig().worker_ray_resources(cluster_has_gpus=False)
    assert ClusterConfig().worker_ray_resources(cluster_has_gpus=True)["num_gpus"] == 1
    cpu = ClusterConfig.model_validate({"engine": {"device": "cpu"}})
    assert "num_gpus" not in cpu.worker_ray_resources(cluster_has_gpus=True)


def test_a_cpu_worker_leaves_a_core_to_the_request_path_on_many_cores() -> None:
    cpu, auto = EngineConfig(device="cpu"), EngineConfig(device="auto")
    assert [worker_torch_threads(cpu, None, cores, cuda=True) for cores in (1, 2, 4, 8, 16)] == [
        1, 2, 4, 7, 15,
    ]  # fmt: skip
    assert worker_torch_threads(auto, None, 16, cuda=False) == 15  # auto without a GPU is CPU
    assert worker_torch_threads(auto, None, 16, cuda=True) is None  # a GPU engine keeps torch's
    assert worker_torch_threads(EngineConfig(device="cuda"), None, 16, cuda=True) is None
    assert worker_torch_threads(cpu, 16, 16, cuda=False) == 16  # the config's own count wins


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="affinity masks are Linux's")
def test_a_cpu_worker_counts_the_cores_it_may_run_on_not_the_machines() -> None:
    # a replica's process bound to one core (as `taskset`, a cpuset or a narrow parent would
    # leave it) computes with one thread, whatever the machine has
    probe = (
        "import torch; from cluster.deployment import set_cpu_threads; "
        "from worker.config import EngineConfig; "
        "set_cpu_threads(EngineConfig(device='cpu'), None); print(torch.get_num_threads())"
    )
    bound = subprocess.run(
        [sys.executable, "-c", probe],
        preexec_fn=lambda: os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    assert int(bound.stdout.split()[-1]) == 1


def _cgroup(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text + "\n")
    return root


def test_a_cpu_limit_caps_the_cores_a_cpu_worker_uses(tmp_path: Path) -> None:
    v1_period = {"cpu/cpu.cfs_period_us": "100000"}
    v2 = _cgroup(tmp_path / "v2", {"cpu.max": "150000 100000"})  # a pod's limits.cpu: 1500m
    v1 = _cgroup(tmp_path / "v1", {"cpu/cpu.cfs_quota_us": "200000", **v1_period})
    v2_unlimited = _cgroup(tmp_path / "v2u", {"cpu.max": "max 100000"})
    v1_unlimited = _cgroup(tmp_path / "v1u", {"cpu/cpu.cfs_quota_us": "-1", **v1_period})
    none = _cgroup(tmp_path / "none", {})
    assert cgroup_cpu_limit(v2) == 1.5 and cgroup_cpu_limit(v1) == 2.0
    assert [cgroup_cpu_limit(c) for c in (v2_unlimited, v1_unlimited, none)] == [None] * 3
    mask = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert usable_cores(v2) == 1  # rounded down: threads past the limit wait out each period
    assert [usable_cores(c) for c in (v2_unlimited, v1_unlimited, none)] == [mask] * 3


def test_result_files_name_the_cores_a_benchmark_could_use(monkeypatch: pytest.MonkeyPatch) -> None:
    # a benchmark run under `taskset` or in a pod says so, not only what the machine has
    monkeypatch.setattr(cluster_config.os, "cpu_count", lambda: 16)
    monkeypatch.setattr(cluster_config, "usable_cores", lambda: 16)
    assert cores_text() == "16 cores"
    monkeypatch.setattr(cluster_config, "usable_cores", lambda: 8)
    assert cores_text() == "16 cores (8 usable)"


def test_api_keys_come_from_config_and_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEYS_ENV, "k1, k2")
    assert ClusterConfig.model_validate({"api_keys": ["k0"]}).api_keys == ("k0", "k1", "k2")


def test_config_rejects_bad_values() -> None:
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({"autoscaling": {"min_replicas": 3, "max_replicas": 2}})
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({"advanced": {"router": {"batch_window_ms": -1}}})
    with pytest.raises(ValidationError):
        ClusterConfig.model_validate({"no_such_field": 1})


def test_model_name_defaults_to_the_directory_name() -> None:
    assert ClusterConfig().model_name == "demo"
    assert (
        ClusterConfig.model_validate({"engine": {"model": "/m/Qwen3-8B"}}).model_name == "Qwen3-8B"
    )
    assert ClusterConfig.model_validate({"served_model_name": "x"}).model_name == "x"


# -- protocol ------------------------------------------------------------------------------------


def test_chat_request_maps_onto_sampling_params() -> None:
    req = ChatCompletionRequest.model_validate(
        {
            "model": "demo",
            "messages": [
                {"role": "developer", "content": [{"type": "text", "text": "be brief"}]},
                {"role": "user", "content": "hi"},
            ],
            "max_completion_tokens": 9,
            "max_tokens": 3,
            "logprobs": True,
            "stop": "END",
            "top_k": -1,
            "seed": 5,
        }
    )
    params = req.sampling_params()
    assert (params.max_tokens, params.logprobs, params.stop, params.top_k, params.seed) == (
        9,
        0,
        ("END",),
        0,
        5,
    )
    assert req.template_messages()[0] == {"role": "system", "content": "be brief"}


def test_completion_prompts_take_every_openai_shape() -> None:
    def prompts(p: object) -> object:
        return CompletionRequest.model_validate({"model": "m", "prompt": p}).prompts()

    assert prompts("hi") == ["hi"]
    assert prompts(["a", "b"]) == ["a", "b"]
    assert prompts([1, 2]) == [[1, 2]]
    assert prompts([[1], [2, 3]]) == [[1], [2, 3]]
    assert CompletionRequest.model_validate({"model": "m", "prompt": "x"}).max_tokens == 16


def test_unsupported_features_are_named() -> None:
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    assert (
        ChatCompletionRequest.model_validate({**base, "tool_choice": "auto"}).refused_field()
        == "tool_choice"
    )
    assert (
        ChatCompletionRequest.model_validate(
            {**base, "tool_choice": "none", "store": True}
        ).refused_field()
        is None
    )
    assert (
        CompletionRequest.model_validate(
            {"model": "m", "prompt": "x", "echo": True}
        ).refused_field()
        == "echo"
    )


# -- autoscaling ---------------------------------------------------------------------------------


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


# -- the application -----------------------------------------------------------------------------


def test_one_yaml_builds_the_app_for_kvray_serve_run_and_rayservice(tmp_path) -> None:
    from ray.serve import Application
    from ray.serve.schema import ServeDeploySchema

    from cluster.app import build_app

    args = {
        "engine": {"model": "demo", "num_pages": 64},
        "worker_replicas": 2,
        "advanced": {"router": {"batch_window_ms": 1}},
    }
    rayservice = {
        "applications": [
            {
                "name": "kvray",
                "route_prefix": "/",
                "import_path": "cluster.app:build_app",
                "args": args,
            }
        ]
    }
    ServeDeploySchema.model_validate(rayservice)  # the serveConfigV2 document is valid
    path = tmp_path / "cluster.yaml"
    path.write_text("engine: {model: demo, num_pages: 64}\nworker_replicas: 2\n")
    for source in (args, {"config": str(path)}, str(path), ClusterConfig.model_validate(args)):
        assert isinstance(build_app(source), Application)


# -- the ingress side of a call ------------------------------------------------------------------


class RecordingDispatcher:
    """Stands in for Dispatcher where a GroupStream only needs `send_abort`."""

    def __init__(self) -> None:
        self.aborted: list[tuple[str, list[str]]] = []

    def send_abort(self, replica_id: str, request_ids: list[str]) -> None:
        self.aborted.append((replica_id, request_ids))


def group_of(*request_ids: str) -> Group:
    return Group([EngineRequest(rid, [1, 2, 3], SamplingParams()) for rid in request_ids], ())


def test_group_stream_delivers_frames_queued_after_the_last_finish() -> None:
    async def scenario() -> list[list[RequestDelta]]:
        stream = GroupStream(RecordingDispatcher(), group_of("a", "b"))  # type: ignore[arg-type]
        stream._on_accept("replica-1")
        stream._on_deltas([RequestDelta("a", [5]), RequestDelta("b", [6], finish_reason="length")])
        stream._on_deltas([RequestDelta("a", [7], finish_reason="stop"), RequestDelta("x", [9])])
        return [frame async for frame in stream]

    frames = asyncio.run(scenario())
    assert [[(d.request_id, d.new_token_ids) for d in f] for f in frames] == [
        [("a", [5]), ("b", [6])],
        [("a", [7])],
    ]


def test_a_frame_wakes_the_streams_awaiting_their_first_token_before_the_others() -> None:
    class NoHandle:
        def options(self, **_: object) -> NoHandle:
            return self

    async def scenario() -> list[str]:
        dispatcher = Dispatcher(NoHandle(), 0.0, 8, 60.0, 300.0)
        streams = {rid: GroupStream(dispatcher, group_of(rid)) for rid in ("a", "b", "c")}
        for rid, stream in streams.items():
            stream._on_accept("replica-1")
            dispatcher.live[rid] = stream
        woken: list[str] = []

        async def read(rid: str) -> None:
            async for frame in streams[rid]:
                woken.extend(f"{d.request_id}{d.new_token_ids[0]}" for d in frame)

        readers = [asyncio.ensure_future(read(rid)) for rid in streams]
        session = dispatcher.session("replica-1")
        session._deliver([RequestDelta("a", [1])])
        await asyncio.sleep(0)
        # a and c are under way, b waits for its first token: b is woken first
        session._deliver([RequestDelta("a", [2]), RequestDelta("b", [1]), RequestDelta("c", [1])])
        await asyncio.sleep(0)
        done = [RequestDelta(rid, [9], finish_reason="length") for rid in streams]
        session._deliver(done)
        await asyncio.gather(*readers)
        return woken

    assert asyncio.run(scenario()) == ["a1", "b1", "c1", "a2", "a9", "b9", "c9"]


def test_group_stream_abort_reaches_the_replica_and_ends_the_stream() -> None:
    async def scenario() -> tuple[list[list[RequestDelta]], RecordingDispatcher]:
        dispatcher = RecordingDispatcher()
        stream = GroupStream(dispatcher, group_of("a", "b"))  # type: ignore[arg-type]
        stream._on_accept("replica-1")
        stream._on_deltas([RequestDelta("a", [5], finish_reason="length")])
        stream.abort(["b"])
        stream._on_deltas([RequestDelta("b", [], finish_reason="abort")])  # arrives late: ignored
        return [frame async for frame in stream], dispatcher

    frames, dispatcher = asyncio.run(scenario())
    assert [[d.request_id for d in f] for f in frames] == [["a"]]
    assert dispatcher.aborted == [("replica-1", ["b"])]


def test_group_stream_raises_the_call_error() -> None:
    async def scenario() -> None:
        stream = GroupStream(RecordingDispatcher(), group_of("a"))  # type: ignore[arg-type]
        stream._on_error(CallError("full", "queue full"))
        with pytest.raises(CallError, match="queue full"):
            await stream.accepted()

    asyncio.run(scenario())


def test_a_window_batch_is_split_by_leading_page_so_each_call_keeps_its_affinity() -> None:
    from types import SimpleNamespace

    from cluster.dispatch import _by_leading_page

    def stream(*first_pages: int) -> SimpleNamespace:
        hashes = tuple((p, 99) for p in first_pages)
        return SimpleNamespace(group=SimpleNamespace(page_hashes=hashes))

    a1, b, a2, short1, short2 = stream(1), stream(2), stream(1), stream(), stream()
    calls = _by_leading_page([a1, b, a2, short1, short2])
    assert calls == [[a1, a2], [b], [short1, short2]]


def test_affinity_holds_while_load_is_within_the_ratio_and_yields_past_it() -> None:
    hint = RouteHint(page_hashes=((7, 8),), num_requests=1)
    cached = ReplicaView("cached", load=70.0, keys=frozenset({7, 8}))
    idle = ReplicaView("other", load=60.0)
    # 10 more requests is past the absolute threshold but within 1.25x: affinity decides
    assert rank_replicas(hint, [idle, cached], 8.0, 1.25)[0] == "cached"
    # past both (80 > 60 + 8 and 80 > 1.25 x 60): load decides
    busy = ReplicaView("cached", load=80.0, keys=frozenset({7, 8}))
    assert rank_replicas(hint, [idle, busy], 8.0, 1.25)[0] == "other"
    # ratio 1.0 is the absolute threshold alone
    assert rank_replicas(hint, [idle, cached], 8.0, 1.0)[0] == "other"


def test_a_prefix_sent_to_a_replica_stays_there_through_reports_that_predate_its_pages() -> None:
    """A replica reports while the call is still queued or in its prompt step: its keys lack
    the prefix's pages. The next call with the same prefix must still go where the first one
    went (before, that report erased the router's claim and the tie went to a random replica)."""
    import time
    from collections import namedtuple
    from types import SimpleNamespace

    from cluster.router import PrefixLoadRouter

    ReplicaKey = namedtuple("ReplicaKey", "unique_id")  # hashable, like Serve's ReplicaID

    router = object.__new__(PrefixLoadRouter)
    router.initialize_state(imbalance_threshold=8.0, memory_s=10.0)
    replicas = [
        SimpleNamespace(replica_id=ReplicaKey(name), routing_stats={"time": 1.0, "prefix_keys": []})
        for name in ("a", "b")
    ]
    hint = RouteHint(page_hashes=((11, 12, 13),), num_requests=1, num_tokens=60)
    chosen = []
    for i in range(8):
        call = SimpleNamespace(args=[hint], metadata=SimpleNamespace(internal_request_id=f"r{i}"))
        ranked = asyncio.run(router.choose_replicas(replicas, call))  # type: ignore[arg-type]
        chosen.append(ranked[0][0].replica_id.unique_id)
        for r in replicas:  # both report again, idle, without the prefix (taken too early)
            r.routing_stats = {"time": time.time() + 0.001, "prefix_keys": [], "num_running": 0}
    assert len(set(chosen)) == 1, chosen


def test_calls_a_busy_replica_has_not_answered_yet_count_in_its_load() -> None:
    """A burst of calls: replica `quick` answers each call at once (its reports count them
    waiting), replica `slow` is too busy to run the calls it was sent before it reports again.
    Its reports then show no load; the calls it has not answered must still count, or it
    looks idle and takes the whole burst (before: the router counted only calls sent after a
    report's time, and on two H200s one replica got 72 % of a 1,024-request burst)."""
    import time
    from collections import namedtuple
    from types import SimpleNamespace

    from cluster.router import PrefixLoadRouter

    ReplicaKey = namedtuple("ReplicaKey", "unique_id")
    router = object.__new__(PrefixLoadRouter)
    router.initialize_state(imbalance_threshold=8.0, memory_s=10.0)
    quick = SimpleNamespace(replica_id=ReplicaKey("quick"), routing_stats={})
    slow = SimpleNamespace(replica_id=ReplicaKey("slow"), routing_stats={})
    counts = {"quick": 0, "slow": 0}
    for i in range(100):
        hint = RouteHint(num_requests=1, num_tokens=50, sender="ingress-1")
        call = SimpleNamespace(args=[hint], metadata=SimpleNamespace(internal_request_id=f"r{i}"))
        ranked = asyncio.run(router.choose_replicas([quick, slow], call))  # type: ignore[arg-type]
        counts[ranked[0][0].replica_id.unique_id] += 1
        now = time.time() + 0.001
        quick.routing_stats = {
            "time": now,
            "num_waiting": counts["quick"],
            "answered": {"ingress-1": counts["quick"]},
        }
        slow.routing_stats = {"time": now, "num_waiting": 0, "answered": {"ingress-1": 0}}
    assert abs(counts["quick"] - counts["slow"]) <= 2, counts
    # once `slow` answers (and reports them waiting), its load is what it reports
    slow.routing_stats = {
        "time": time.time() + 0.002,
        "num_waiting": counts["slow"],
        "answered": {"ingress-1": counts["slow"]},
    }
    assert router._view(slow).load == counts["slow"]  # type: ignore[arg-type]


def test_a_senders_count_missing_from_reports_weighs_only_its_recent_sends(monkeypatch) -> None:
    """A replica reports only the senders of the last 10 minutes, with counts kept from the
    start. While its report lacks this router's count, the router's recent sends count as
    unanswered, never its whole history; once reported again, the counts agree."""
    from collections import namedtuple
    from types import SimpleNamespace

    import cluster.router as router_mod

    clock = [1000.0]
    monkeypatch.setattr(router_mod.time, "time", lambda: clock[0])
    ReplicaKey = namedtuple("ReplicaKey", "unique_id")
    router = object.__new__(router_mod.PrefixLoadRouter)
    router.initialize_state(memory_s=10.0)
    replica = SimpleNamespace(replica_id=ReplicaKey("a"), routing_stats={})

    def send(i: int) -> None:
        hint = RouteHint(num_requests=1, sender="ingress-1")
        call = SimpleNamespace(args=[hint], metadata=SimpleNamespace(internal_request_id=f"r{i}"))
        asyncio.run(router.choose_replicas([replica], call))  # type: ignore[arg-type]

    for i in range(5):
        send(i)
    replica.routing_stats = {"time": clock[0], "answered": {"ingress-1": 5}}
    assert router._view(replica).load == 0  # type: ignore[arg-type]
    replica.routing_stats = {"time": clock[0], "answered": {}}  # this sender not reported
    assert router._view(replica).load == 5  # type: ignore[arg-type]  # its recent sends
    clock[0] += 11.0
    assert router._view(replica).load == 0  # type: ignore[arg-type]  # ...not its history
    send(5)
    assert router._view(replica).load == 1  # type: ignore[arg-type]
    replica.routing_stats = {"time": clock[0], "answered": {"ingress-1": 6}}
    assert router._view(replica).load == 0  # type: ignore[arg-type]


def test_api_keys_never_reach_a_printed_config_or_the_serve_banner() -> None:
    from cluster.cli import _examples

    config = ClusterConfig.model_validate({"api_keys": ["sekrit-123"]})
    assert "sekrit-123" not in repr(config) and "sekrit-123" not in str(config)
    banner = _examples(config)
    assert "sekrit-123" not in banner and "$KVRAY_API_KEY" in banner
    assert 'api_key="unused"' in _examples(ClusterConfig())


def test_merge_steps_gives_one_delta_per_request_in_step_order() -> None:
    from worker.outputs import merge_steps

    lp = [TokenLogprobs(5, -0.5, {5: -0.5}), TokenLogprobs(6, -0.1, {6: -0.1})]
    steps = [
        [RequestDelta("a", [5], lp[:1], num_prompt_tokens=3), RequestDelta("b", [9])],
        [RequestDelta("a", [6], lp[1:], "length", num_prompt_tokens=3, num_cached_tokens=2)],
        [RequestDelta("b", [], None, "abort")],
    ]
    a, b = merge_steps(steps)
    assert (a.request_id, a.new_token_ids, a.logprobs, a.finish_reason) == (
        "a",
        [5, 6],
        lp,
        "length",
    )
    assert (a.num_prompt_tokens, a.num_cached_tokens) == (3, 2)
    assert (b.request_id, b.new_token_ids, b.finish_reason) == ("b", [9], "abort")
    assert merge_steps([steps[0]]) == steps[0]


def test_the_model_list_names_the_context_length_from_its_first_request(monkeypatch) -> None:
    """/v1/models asks a worker for the context length if nothing has yet, and answers
    without it (rather than an error) when no worker can say."""
    import json
    from types import SimpleNamespace

    from starlette.requests import Request

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]  # the class under serve.ingress's wrapper
    context = SimpleNamespace(replica_id=SimpleNamespace(unique_id="ing-1"))
    monkeypatch.setattr(api.serve, "get_replica_context", lambda: context)

    class Worker:
        def __init__(self, answer: dict[str, int] | None):
            self.answer, self.asked = answer, 0
            self.info = self

        def options(self, **_: object) -> Worker:
            return self

        async def remote(self, hint: RouteHint) -> dict[str, int]:
            self.asked += 1
            if self.answer is None:
                raise RuntimeError("no replica")
            return self.answer

    async def listed(worker: Worker) -> list[dict[str, object]]:
        ingress = ingress_class(ClusterConfig(), worker)
        bodies = [await ingress.models(Request({"type": "http", "headers": []})) for _ in range(2)]
        return [json.loads(bytes(b.body))["data"][0] for b in bodies]

    worker = Worker({"max_seq_len": 512})
    assert [m["max_model_len"] for m in asyncio.run(listed(worker))] == [512, 512]
    assert worker.asked == 1
    assert [m["max_model_len"] for m in asyncio.run(listed(Worker(None)))] == [None, None]


def test_a_responses_engine_requests_are_named_after_its_id() -> None:
    """Prompt p's choice i of response `rid` is the engine request `{rid}-p-i`: a request id
    in a worker's log names the response."""
    from types import SimpleNamespace

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]  # the class under serve.ingress's wrapper
    ingress = SimpleNamespace(_config=ClusterConfig())
    group = ingress_class._group(
        ingress,
        "cmpl-7",
        [[1, 2], [3]],
        SamplingParams(seed=5),
        2,
        {"prefix_cache": False, "max_seq_len": 64},
    )
    assert [r.request_id for r in group.requests] == [
        "cmpl-7-0-0",
        "cmpl-7-0-1",
        "cmpl-7-1-0",
        "cmpl-7-1-1",
    ]
    assert [r.params.seed for r in group.requests] == [5, 6, 5, 6]  # n > 1: one seed a choice


def test_the_operators_default_max_tokens_is_fitted_to_each_prompts_context() -> None:
    """A request that took the operator's cap as its default stops where the context ends; the
    ingress sends it with max_tokens fitted, so the worker's own context check passes it."""
    from types import SimpleNamespace

    import cluster.api as api

    ingress_class = api.Ingress.__mro__[1]
    ingress = SimpleNamespace(_config=ClusterConfig())
    params = SamplingParams(max_tokens=50, min_tokens=40)
    info = {"prefix_cache": False, "max_seq_len": 64}
    group = ingress_class._group(ingress, "cmpl-8", [[1] * 30, [2] * 4], params, 1, info)
    assert [(r.params.max_tokens, r.params.min_tokens) for r in group.requests] == [
        (34, 34),
        (50, 40),
    ]
