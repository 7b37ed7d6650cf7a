"""ClusterConfig: YAML, validation, API keys, worker resources and CPU threads."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.config import API_KEYS_ENV, ClusterConfig, worker_torch_threads
from worker.config import EngineConfig
from worker.cores import cgroup_cpu_limit, usable_cores

REPO = Path(__file__).resolve().parents[2]


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


def test_ingress_replicas_default_to_two_per_worker_within_the_cpus() -> None:
    """One ingress streams about one 8B GPU replica's tokens (docs/serving.md): two per
    worker replica by default, at most one per 4 CPUs, at least one; a set number stands."""
    assert ClusterConfig(worker_replicas=2).ingress_count(cluster_cpus=16) == 4
    assert ClusterConfig(worker_replicas=2).ingress_count(cluster_cpus=8) == 2
    assert ClusterConfig(worker_replicas=1).ingress_count(cluster_cpus=2) == 1
    scaled = ClusterConfig(autoscaling={"min_replicas": 1, "max_replicas": 8})
    assert scaled.ingress_count(cluster_cpus=128) == 16
    assert ClusterConfig(worker_replicas=4, ingress_replicas=3).ingress_count(64) == 3


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


def test_api_keys_never_reach_a_printed_config_or_the_serve_banner() -> None:
    from cluster.cli import _examples

    config = ClusterConfig.model_validate({"api_keys": ["sekrit-123"]})
    assert "sekrit-123" not in repr(config) and "sekrit-123" not in str(config)
    banner = _examples(config)
    assert "sekrit-123" not in banner and "$KVRAY_API_KEY" in banner
    assert 'api_key="unused"' in _examples(ClusterConfig())


def test_serve_flags_override_the_yaml(tmp_path) -> None:
    from cluster.cli import _parser, _serve_config

    path = tmp_path / "cluster.yaml"
    path.write_text("reasoning_parser: qwen3\nport: 9000\n")
    args = _parser().parse_args(["serve", "-c", str(path), "--reasoning-parser", "deepseek_r1"])
    config = _serve_config(args)
    assert (config.reasoning_parser, config.port) == ("deepseek_r1", 9000)
    assert (
        _serve_config(_parser().parse_args(["serve", "-c", str(path)])).reasoning_parser == "qwen3"
    )


def test_the_cli_ends_a_bad_config_or_a_missing_model_with_its_faults(tmp_path) -> None:
    from cluster.cli import _check_model_here, _parser, _serve_config, main

    path = tmp_path / "bad.yaml"
    args = _parser().parse_args(["serve", "-c", str(path)])
    path.write_text("engine: {model: demo, max_runing: 8}\nport: eighty\n")
    with pytest.raises(SystemExit) as caught:
        _serve_config(args)
    lines = str(caught.value).splitlines()
    assert lines[0] == f"kvray serve: {path}: not a valid config"
    assert "  engine.max_runing: Extra inputs are not permitted" in lines
    assert any(line.startswith("  port: ") for line in lines)
    for text in ("- a list\n", "engine: {model: demo\n"):  # not a mapping; not YAML
        path.write_text(text)
        with pytest.raises(SystemExit, match=f"kvray serve: {path}: "):
            _serve_config(args)
    path.unlink()
    with pytest.raises(SystemExit, match="No such file"):
        _serve_config(args)
    with pytest.raises(SystemExit, match="neither 'demo' nor an existing directory"):
        _check_model_here(str(tmp_path / "no-model"))
    _check_model_here(str(tmp_path))  # a directory: the engine loads it, or says why not
    with pytest.raises(SystemExit, match="kvray generate: model .* neither 'demo'"):
        main(["generate", "--model", str(tmp_path / "no-model"), "Hi"])
    with pytest.raises(SystemExit) as caught:  # before the model path is even looked at
        main(["generate", "--model", str(tmp_path / "no-model"), "--max-tokens", "-3", "Hi"])
    lines = str(caught.value).splitlines()
    assert lines[0] == "kvray generate: not valid sampling options"
    assert lines[1].startswith("  max_tokens: Input should be greater than or equal to 0")
