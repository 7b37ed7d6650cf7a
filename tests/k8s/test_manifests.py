"""k8s/ without a cluster: every manifest parses, the overlays compose (as kubectl would),
every field exists in the KubeRay / Kubernetes structure, serveConfigV2 is a valid Serve
config whose application builds, and the pieces agree with each other (ports, GPUs per pod
and replicas per pod, autoscaling bounds, drain timeouts, probes, the model volume)."""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import ray
import yaml
from ray import serve
from ray.serve.schema import ServeDeploySchema

from cluster.app import INGRESS_NAME, SERVE_ENV, WORKER_NAME
from cluster.config import ClusterConfig
from tests.k8s import crd_structure
from tests.k8s.kustomize import KustomizeError, build
from tests.k8s.manifests import (
    K8S,
    OVERLAYS,
    Overlay,
    claim_mounts,
    compose,
    container_port,
    cpu_quantity,
)


@pytest.fixture(scope="module", params=OVERLAYS)
def overlay(request: pytest.FixtureRequest) -> Overlay:
    return compose(request.param)


def test_every_manifest_file_parses() -> None:
    """Each YAML file is resources / a kustomization (apiVersion + kind) or a JSON patch."""
    files = sorted(K8S.rglob("*.yaml"))
    assert len(files) >= 9
    for path in files:
        documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        assert documents, f"{path} holds no document"
        for document in documents:
            if isinstance(document, list):
                assert all({"op", "path"} <= set(op) for op in document), path
            else:
                assert {"apiVersion", "kind"} <= set(document), path


def _by_identity(resources: list[dict]) -> dict[tuple[str, str], dict]:
    return {(r["kind"], r["metadata"]["name"]): r for r in resources}


@pytest.mark.parametrize(
    "directory", ["base", "overlays/cpu-demo", "overlays/gpu", "monitoring", "network-policy"]
)
def test_python_composition_equals_kubectl_kustomize(directory: str) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed; the Python composition is checked on its own")
    out = subprocess.run(
        [kubectl, "kustomize", str(K8S / directory)], capture_output=True, text=True, check=True
    ).stdout
    expected = [d for d in yaml.safe_load_all(out) if d]
    assert _by_identity(build(K8S / directory)) == _by_identity(expected)


@pytest.mark.parametrize(
    "directory", ["base", "overlays/cpu-demo", "overlays/gpu", "monitoring", "network-policy"]
)
def test_every_field_exists_in_the_crd_structure(directory: str) -> None:
    for resource in build(K8S / directory):
        assert crd_structure.problems(resource) == [], resource["kind"]


def test_structure_check_catches_unknown_fields_and_wrong_types() -> None:
    service = compose("gpu").rayservice
    service["spec"]["rayClusterConfig"]["enableInTreeAutosclaing"] = True
    service["spec"]["rayClusterConfig"]["headGroupSpec"]["rayStartParams"]["num-gpus"] = 0
    del service["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["groupName"]
    found = crd_structure.problems(service)
    assert any("enableInTreeAutosclaing: unknown field" in p for p in found)
    assert any("num-gpus: 0 is not a string" in p for p in found)
    assert any("missing required field 'groupName'" in p for p in found)


def test_composer_refuses_what_it_does_not_implement(tmp_path: Path) -> None:
    (tmp_path / "kustomization.yaml").write_text(
        "kind: Kustomization\nresources: []\nimages: [{name: kvray, newTag: x}]\n"
    )
    with pytest.raises(KustomizeError, match="images"):
        build(tmp_path)


def test_serve_config_validates_with_rays_schema(overlay: Overlay) -> None:
    schema = ServeDeploySchema.model_validate(overlay.serve_config)
    assert [a.name for a in schema.applications] == ["kvray"]


def test_import_path_imports_and_builds_an_application(overlay: Overlay) -> None:
    module_name, _, attr = overlay.application["import_path"].partition(":")
    builder = getattr(importlib.import_module(module_name), attr)
    assert isinstance(builder(overlay.application["args"]), serve.Application)


def test_cluster_config_is_what_kvray_serve_reads(overlay: Overlay, tmp_path: Path) -> None:
    """The app's args are a ClusterConfig document: `kvray serve -c` of it gives the same."""
    path = tmp_path / "cluster.yaml"
    path.write_text(yaml.safe_dump(overlay.application["args"]))
    assert ClusterConfig.from_yaml(path) == overlay.cluster_config
    assert overlay.cluster_config.autoscaling is not None


def test_app_name_route_and_port_agree_everywhere(overlay: Overlay) -> None:
    config, serve_config = overlay.cluster_config, overlay.serve_config
    assert overlay.application["name"] == config.advanced.app_name
    assert overlay.application["route_prefix"] == config.advanced.route_prefix
    http = serve_config["http_options"]
    assert http["host"] == config.host == "0.0.0.0"
    assert http["port"] == config.port
    assert container_port(overlay.head_container, "serve") == config.port
    assert container_port(overlay.worker_container, "serve") == config.port
    assert serve_config["proxy_location"] == "EveryNode"  # every pod's proxy serves traffic


def test_head_runs_no_worker_replica_and_holds_the_ingress(overlay: Overlay) -> None:
    params = overlay.head_group["rayStartParams"]
    assert params["num-gpus"] == "0"
    assert "nvidia.com/gpu" not in overlay.head_container["resources"]["limits"]
    assert not overlay.head_group.get("resources")  # no custom resource a worker could ask for
    config = overlay.cluster_config
    assert config.ingress_replicas * config.advanced.ingress_num_cpus <= float(params["num-cpus"])
    assert float(params["num-cpus"]) <= cpu_quantity(
        overlay.head_container["resources"]["limits"]["cpu"]
    )


def _replicas_per_worker_pod(overlay: Overlay) -> int:
    """How many worker replicas fit on one worker pod, by the replica's GPU/custom resources."""
    options = overlay.cluster_config.worker_ray_resources(cluster_has_gpus=False)
    offered = {
        "num_gpus": float(overlay.worker_container["resources"]["limits"].get("nvidia.com/gpu", 0)),
        **{k: float(v) for k, v in overlay.worker_group.get("resources", {}).items()},
    }
    wanted = {"num_gpus": options.get("num_gpus", 0), **options.get("resources", {})}
    fits = [int(offered.get(name, 0) // amount) for name, amount in wanted.items() if amount]
    assert fits, "the worker replica asks for no GPU or custom resource: it could land on the head"
    return min(fits)


def test_one_worker_replica_per_worker_pod(overlay: Overlay) -> None:
    assert _replicas_per_worker_pod(overlay) == 1


def test_gpu_workers_get_one_gpu_each_whatever_the_cluster_holds_at_build_time() -> None:
    gpu = compose("gpu")
    assert gpu.worker_container["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert gpu.cluster_config.worker_ray_resources(cluster_has_gpus=False)["num_gpus"] == 1
    assert gpu.cluster_config.engine.device == "cuda"
    tolerated = {t["key"] for t in gpu.worker_group["template"]["spec"]["tolerations"]}
    assert "nvidia.com/gpu" in tolerated


def test_serve_autoscaling_bounds_match_worker_pod_bounds(overlay: Overlay) -> None:
    assert overlay.cluster_spec["enableInTreeAutoscaling"] is True
    auto = overlay.cluster_config.autoscaling
    assert auto is not None
    per_pod = _replicas_per_worker_pod(overlay)
    group = overlay.worker_group
    assert 1 <= auto.min_replicas == group["minReplicas"] * per_pod
    assert auto.max_replicas == group["maxReplicas"] * per_pod
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    advanced = overlay.cluster_config.advanced
    assert advanced.upscale_delay_s < advanced.downscale_delay_s


def test_graceful_drain_outlasts_running_generations(overlay: Overlay) -> None:
    names = {d["name"] for d in overlay.application.get("deployments", [])}
    assert names <= {WORKER_NAME, INGRESS_NAME}, "an override must name a kvray deployment"
    worker = overlay.deployment_options(WORKER_NAME)
    timeout = worker["graceful_shutdown_timeout_s"]
    assert worker["graceful_shutdown_wait_loop_s"] <= 5
    assert timeout >= 60
    ingress = overlay.deployment_options(INGRESS_NAME)  # it streams the same responses
    assert ingress["graceful_shutdown_timeout_s"] >= timeout
    assert overlay.worker_group["template"]["spec"]["terminationGracePeriodSeconds"] > timeout
    assert overlay.rayservice["spec"]["rayClusterDeletionDelaySeconds"] > timeout
    assert overlay.rayservice["spec"]["upgradeStrategy"]["type"] == "NewCluster"


def test_worker_readiness_follows_serve_and_liveness_only_ray(overlay: Overlay) -> None:
    port = overlay.cluster_config.port
    readiness = " ".join(overlay.worker_container["readinessProbe"]["exec"]["command"])
    assert f"localhost:{port}/-/healthz" in readiness and "grep success" in readiness
    assert "local_raylet_healthz" in readiness
    liveness = overlay.worker_container["livenessProbe"]
    assert liveness["httpGet"]["path"] == "/api/healthz" and "exec" not in liveness
    assert overlay.worker_container["readinessProbe"]["failureThreshold"] == 1
    assert overlay.head_container["livenessProbe"]["httpGet"]["path"] == "/api/healthz"


def test_every_gpu_pod_mounts_the_model_volume() -> None:
    """Workers load the weights and the ingress (on the head) loads the tokenizer."""
    gpu = compose("gpu")
    model = gpu.cluster_config.engine.model
    for group in (gpu.head_group, gpu.worker_group):
        pod = group["template"]["spec"]
        mounts = claim_mounts(pod["containers"][0], pod)
        assert any(model.startswith(path.rstrip("/") + "/") for path in mounts), group
        assert set(mounts.values()) <= gpu.persistent_claims()
        assert all(m.get("readOnly") for m in pod["containers"][0]["volumeMounts"])


def test_cpu_demo_runs_the_image_s_demo_model_with_threads_that_fit_the_pod() -> None:
    demo = compose("cpu-demo")
    config = demo.cluster_config
    assert config.engine.model == "demo" and config.engine.device == "cpu"
    assert _dockerfile_arg("WITH_DEMO") == "1"  # converted into the image at build time
    limit = cpu_quantity(demo.worker_container["resources"]["limits"]["cpu"])
    assert (
        config.advanced.worker_cpu_threads is not None
        and config.advanced.worker_cpu_threads <= limit
    )


def _dockerfile_arg(name: str) -> str:
    match = re.search(rf"^ARG {name}=(\S+)$", (K8S / "Dockerfile").read_text(), re.MULTILINE)
    assert match, f"k8s/Dockerfile has no ARG {name}"
    return match.group(1)


def test_image_ray_version_is_the_clusters_and_the_tested_one(overlay: Overlay) -> None:
    assert overlay.cluster_spec["rayVersion"] == _dockerfile_arg("RAY_VERSION") == ray.__version__
    flavor = "cpu" if overlay.cluster_config.engine.device == "cpu" else "gpu"
    for container in (overlay.head_container, overlay.worker_container):
        assert container["image"].endswith(f"-{flavor}"), container["image"]


def test_every_pod_runs_with_kvrays_serve_settings(overlay: Overlay) -> None:
    """Ray and Serve read kvray's settings (the data plane, the workers' niceness) when a
    process starts: every pod must set them."""
    for container in (overlay.head_container, overlay.worker_container):
        env = {e["name"]: e.get("value") for e in container.get("env", [])}
        for key, value in SERVE_ENV.items():
            assert env.get(key) == value, (container["name"], key)


@pytest.mark.parametrize("name", OVERLAYS)
def test_ray_token_auth_is_on_and_network_policies_fence_the_ray_ports(name: str) -> None:
    """Every Ray RPC needs the cluster's token, and from outside the cluster's own pods only
    Serve's HTTP port (API keys) and the metrics port reach a kvray pod."""
    overlay = compose(name)
    assert overlay.cluster_spec["authOptions"] == {"mode": "token"}
    policies = {p["metadata"]["name"]: p for p in build(K8S / "network-policy")}
    assert set(policies) == {"kvray-workers", "kvray-head"}
    open_ports = {
        overlay.cluster_config.port,
        container_port(overlay.worker_container, "metrics"),
    }
    for policy, group in (
        ("kvray-workers", overlay.worker_group),
        ("kvray-head", overlay.head_group),
    ):
        spec = policies[policy]["spec"]
        labels = group["template"]["metadata"]["labels"]
        assert spec["podSelector"]["matchLabels"].items() <= labels.items(), policy
        assert spec["policyTypes"] == ["Ingress"]
        for rule in spec["ingress"]:
            if "from" in rule:  # any port, but only from these peers
                assert "ports" not in rule
                for peer in rule["from"]:
                    pods = peer.get("podSelector", {}).get("matchLabels", {})
                    namespaces = peer.get("namespaceSelector", {}).get("matchLabels", {})
                    assert pods == {"app.kubernetes.io/name": "kvray"} or namespaces, peer
            else:  # from anywhere, but only these ports
                assert {p["port"] for p in rule["ports"]} == open_ports, policy
