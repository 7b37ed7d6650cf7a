"""The composed k8s/ overlays, and the pieces of them the tests look at."""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any

import yaml

from cluster.app import load_config
from cluster.config import ClusterConfig
from tests.k8s.kustomize import Resource, build

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "k8s"
OVERLAYS = ("cpu-demo", "gpu")


@dataclass(frozen=True)
class Overlay:
    """One overlay of k8s/overlays, composed."""

    name: str
    resources: tuple[Resource, ...]

    @property
    def directory(self) -> Path:
        return K8S / "overlays" / self.name

    @cached_property
    def rayservice(self) -> Resource:
        (service,) = [r for r in self.resources if r["kind"] == "RayService"]
        return service

    @property
    def cluster_spec(self) -> dict[str, Any]:
        return self.rayservice["spec"]["rayClusterConfig"]

    @property
    def head_group(self) -> dict[str, Any]:
        return self.cluster_spec["headGroupSpec"]

    @property
    def worker_group(self) -> dict[str, Any]:
        (group,) = self.cluster_spec["workerGroupSpecs"]
        return group

    @property
    def head_container(self) -> dict[str, Any]:
        return self.head_group["template"]["spec"]["containers"][0]

    @property
    def worker_container(self) -> dict[str, Any]:
        return self.worker_group["template"]["spec"]["containers"][0]

    @cached_property
    def serve_config(self) -> dict[str, Any]:
        """spec.serveConfigV2, parsed (it is a YAML document inside a string)."""
        return yaml.safe_load(self.rayservice["spec"]["serveConfigV2"])

    @property
    def application(self) -> dict[str, Any]:
        (app,) = self.serve_config["applications"]
        return app

    @cached_property
    def cluster_config(self) -> ClusterConfig:
        return load_config(self.application["args"])

    def deployment_options(self, name: str) -> dict[str, Any]:
        """The serveConfigV2 overrides of one Serve deployment ({} when it has none)."""
        for options in self.application.get("deployments", []):
            if options["name"] == name:
                return options
        return {}

    def persistent_claims(self) -> set[str]:
        return {
            r["metadata"]["name"] for r in self.resources if r["kind"] == "PersistentVolumeClaim"
        }


def compose(name: str) -> Overlay:
    return Overlay(name, tuple(build(K8S / "overlays" / name)))


def container_port(container: dict[str, Any], name: str) -> int:
    (port,) = [p["containerPort"] for p in container.get("ports", []) if p.get("name") == name]
    return int(port)


def cpu_quantity(value: str | int) -> float:
    """A Kubernetes CPU quantity ("2", "500m", 4) in cores."""
    text = str(value)
    return float(text[:-1]) / 1000 if text.endswith("m") else float(text)


def claim_mounts(container: dict[str, Any], pod: dict[str, Any]) -> dict[str, str]:
    """mountPath -> PVC claim name, for the PVC volumes this container mounts."""
    claims = {
        v["name"]: v["persistentVolumeClaim"]["claimName"]
        for v in pod.get("volumes", [])
        if "persistentVolumeClaim" in v
    }
    return {
        m["mountPath"]: claims[m["name"]]
        for m in container.get("volumeMounts", [])
        if m["name"] in claims
    }
