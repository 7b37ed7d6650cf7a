"""The field structure the API server accepts for the kinds k8s/ writes, as data.

An unknown field in a custom resource is pruned silently by the API server (or rejected
under strict field validation), so a misspelt `enableInTreeAutosclaing` would quietly
deploy a cluster that never scales. `problems(document)` walks a manifest and reports every
field that is not in the structure below, every value of the wrong type (rayStartParams
values must be strings, for example) and every missing required field.

Sources, read 2026-11-29:
- RayService / RayCluster (ray.io/v1): ray-project/kuberay, ray-operator/apis/ray/v1/
  rayservice_types.go and raycluster_types.go (the json tags), at a v1.5-era revision (with
  `upgradeStrategy`, `rayClusterDeletionDelaySeconds`, group `resources`/`labels`) and at
  master. Target release: KubeRay v1.5.1. Only fields present in both are listed;
  `rayClusterDeletionDelaySeconds` and group `resources`/`labels` need v1.5.0 or newer.
  Enums are those of the kubebuilder markers (UpscalingMode) and of the Go constants.
- Pod template, PVC (core/v1): the Kubernetes API, stable fields only.
- RayCluster `authOptions` (KubeRay v1.5.1+, Ray token authentication).
- NetworkPolicy (networking.k8s.io/v1): the stable fields k8s/network-policy uses.
- ServiceMonitor / PodMonitor (monitoring.coreos.com/v1): Prometheus Operator's API; the few
  long-stable fields k8s/monitoring uses, written from its API reference, not fetched here.
Subtrees kvray does not write are marked ANY and not descended.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Obj:
    """A JSON object with these fields (name -> structure); `required` must be present."""

    fields: dict[str, Any]
    required: tuple[str, ...] = ()


@dataclass(frozen=True)
class ListOf:
    item: Any


@dataclass(frozen=True)
class Enum:
    values: tuple[str, ...]


@dataclass(frozen=True)
class MapOf:
    """A JSON object with free keys, every value of one structure."""

    value: Any = field(default="string")


ANY = "any"
STRING, INTEGER, BOOLEAN = "string", "integer", "boolean"
QUANTITY = "quantity"  # integer, or a string like 500m / 8Gi
INT_OR_STRING = "int-or-string"
STRING_MAP = MapOf("string")

_QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([KMGTPE]i|[numkMGTPE]|[eE][+-]?\d+)?$")

# -- Kubernetes core/v1 --------------------------------------------------------------------

OBJECT_META = Obj(
    {"name": STRING, "namespace": STRING, "labels": STRING_MAP, "annotations": STRING_MAP}
)
RESOURCE_REQUIREMENTS = Obj({"limits": MapOf(QUANTITY), "requests": MapOf(QUANTITY)})
PROBE = Obj(
    {
        "exec": Obj({"command": ListOf(STRING)}),
        "httpGet": Obj(
            {"path": STRING, "port": INT_OR_STRING, "host": STRING, "scheme": STRING},
            required=("port",),
        ),
        "tcpSocket": Obj({"port": INT_OR_STRING}, required=("port",)),
        "initialDelaySeconds": INTEGER,
        "periodSeconds": INTEGER,
        "timeoutSeconds": INTEGER,
        "failureThreshold": INTEGER,
        "successThreshold": INTEGER,
        "terminationGracePeriodSeconds": INTEGER,
    }
)
KEY_REF = Obj({"name": STRING, "key": STRING, "optional": BOOLEAN}, required=("key",))
ENV_VAR = Obj(
    {
        "name": STRING,
        "value": STRING,
        "valueFrom": Obj(
            {
                "secretKeyRef": KEY_REF,
                "configMapKeyRef": KEY_REF,
                "fieldRef": Obj({"fieldPath": STRING, "apiVersion": STRING}, ("fieldPath",)),
            }
        ),
    },
    required=("name",),
)
CONTAINER = Obj(
    {
        "name": STRING,
        "image": STRING,
        "imagePullPolicy": Enum(("Always", "IfNotPresent", "Never")),
        "command": ListOf(STRING),
        "args": ListOf(STRING),
        "env": ListOf(ENV_VAR),
        "ports": ListOf(
            Obj(
                {"containerPort": INTEGER, "name": STRING, "protocol": STRING},
                required=("containerPort",),
            )
        ),
        "resources": RESOURCE_REQUIREMENTS,
        "volumeMounts": ListOf(
            Obj(
                {"name": STRING, "mountPath": STRING, "readOnly": BOOLEAN, "subPath": STRING},
                required=("name", "mountPath"),
            )
        ),
        "livenessProbe": PROBE,
        "readinessProbe": PROBE,
        "startupProbe": PROBE,
        "lifecycle": Obj({"preStop": ANY, "postStart": ANY}),
        "securityContext": ANY,
    },
    required=("name",),
)
VOLUME = Obj(
    {
        "name": STRING,
        "persistentVolumeClaim": Obj(
            {"claimName": STRING, "readOnly": BOOLEAN}, required=("claimName",)
        ),
        "emptyDir": Obj({"medium": STRING, "sizeLimit": QUANTITY}),
        "configMap": ANY,
        "secret": ANY,
    },
    required=("name",),
)
TOLERATION = Obj(
    {
        "key": STRING,
        "operator": Enum(("Exists", "Equal")),
        "value": STRING,
        "effect": Enum(("NoSchedule", "PreferNoSchedule", "NoExecute")),
        "tolerationSeconds": INTEGER,
    }
)
POD_TEMPLATE = Obj(
    {
        "metadata": OBJECT_META,
        "spec": Obj(
            {
                "containers": ListOf(CONTAINER),
                "initContainers": ListOf(CONTAINER),
                "volumes": ListOf(VOLUME),
                "terminationGracePeriodSeconds": INTEGER,
                "nodeSelector": STRING_MAP,
                "tolerations": ListOf(TOLERATION),
                "affinity": ANY,
                "serviceAccountName": STRING,
                "priorityClassName": STRING,
                "imagePullSecrets": ListOf(Obj({"name": STRING})),
                "securityContext": ANY,
            },
            required=("containers",),
        ),
    }
)
PVC = Obj(
    {
        "apiVersion": STRING,
        "kind": STRING,
        "metadata": OBJECT_META,
        "spec": Obj(
            {
                "accessModes": ListOf(
                    Enum(("ReadWriteOnce", "ReadOnlyMany", "ReadWriteMany", "ReadWriteOncePod"))
                ),
                "resources": RESOURCE_REQUIREMENTS,
                "storageClassName": STRING,
                "volumeMode": Enum(("Filesystem", "Block")),
            }
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

# -- KubeRay ray.io/v1 ----------------------------------------------------------------------

AUTOSCALER_OPTIONS = Obj(
    {
        "resources": RESOURCE_REQUIREMENTS,
        "image": STRING,
        "imagePullPolicy": Enum(("Always", "IfNotPresent", "Never")),
        "securityContext": ANY,
        "idleTimeoutSeconds": INTEGER,
        "upscalingMode": Enum(("Default", "Aggressive", "Conservative")),
        "env": ListOf(ENV_VAR),
        "envFrom": ANY,
        "volumeMounts": ANY,
    }
)
HEAD_GROUP_SPEC = Obj(
    {
        "serviceType": STRING,
        "headService": ANY,
        "enableIngress": BOOLEAN,
        "rayStartParams": STRING_MAP,
        "resources": STRING_MAP,
        "labels": STRING_MAP,
        "template": POD_TEMPLATE,
    },
    # rayStartParams: optional since KubeRay v1.2, required before; kvray always writes it.
    required=("rayStartParams", "template"),
)
WORKER_GROUP_SPEC = Obj(
    {
        "groupName": STRING,
        "replicas": INTEGER,
        "minReplicas": INTEGER,
        "maxReplicas": INTEGER,
        "numOfHosts": INTEGER,
        "rayStartParams": STRING_MAP,
        "resources": STRING_MAP,
        "labels": STRING_MAP,
        "template": POD_TEMPLATE,
        "scaleStrategy": Obj({"workersToDelete": ListOf(STRING)}),
        "suspend": BOOLEAN,
    },
    required=("groupName", "minReplicas", "maxReplicas", "rayStartParams", "template"),
)
RAY_CLUSTER_SPEC = Obj(
    {
        "headGroupSpec": HEAD_GROUP_SPEC,
        "workerGroupSpecs": ListOf(WORKER_GROUP_SPEC),
        "rayVersion": STRING,
        "enableInTreeAutoscaling": BOOLEAN,
        "autoscalerOptions": AUTOSCALER_OPTIONS,
        "headServiceAnnotations": STRING_MAP,
        "suspend": BOOLEAN,
        "gcsFaultToleranceOptions": ANY,
        "authOptions": Obj({"mode": Enum(("disabled", "token")), "secretName": STRING}),
    },
    required=("headGroupSpec",),
)
RAY_SERVICE = Obj(
    {
        "apiVersion": STRING,
        "kind": STRING,
        "metadata": OBJECT_META,
        "spec": Obj(
            {
                "serveConfigV2": STRING,
                "rayClusterConfig": RAY_CLUSTER_SPEC,
                "upgradeStrategy": Obj({"type": Enum(("NewCluster", "None"))}),
                "rayClusterDeletionDelaySeconds": INTEGER,
                "excludeHeadPodFromServeSvc": BOOLEAN,
                "serveService": ANY,
            },
            required=("rayClusterConfig",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

# -- Prometheus Operator monitoring.coreos.com/v1 ------------------------------------------

LABEL_SELECTOR = Obj({"matchLabels": STRING_MAP})
SCRAPE_ENDPOINT = Obj({"port": STRING, "path": STRING, "interval": STRING, "scheme": STRING})
SERVICE_MONITOR = Obj(
    {
        "apiVersion": STRING,
        "kind": STRING,
        "metadata": OBJECT_META,
        "spec": Obj(
            {"selector": LABEL_SELECTOR, "endpoints": ListOf(SCRAPE_ENDPOINT)},
            required=("selector", "endpoints"),
        ),
    }
)
POD_MONITOR = Obj(
    {
        "apiVersion": STRING,
        "kind": STRING,
        "metadata": OBJECT_META,
        "spec": Obj(
            {"selector": LABEL_SELECTOR, "podMetricsEndpoints": ListOf(SCRAPE_ENDPOINT)},
            required=("selector", "podMetricsEndpoints"),
        ),
    }
)

# -- networking.k8s.io/v1 -------------------------------------------------------------------

NETWORK_POLICY_PEER = Obj({"podSelector": LABEL_SELECTOR, "namespaceSelector": LABEL_SELECTOR})
NETWORK_POLICY_PORT = Obj(
    {"port": INT_OR_STRING, "protocol": Enum(("TCP", "UDP", "SCTP")), "endPort": INTEGER}
)
NETWORK_POLICY = Obj(
    {
        "apiVersion": STRING,
        "kind": STRING,
        "metadata": OBJECT_META,
        "spec": Obj(
            {
                "podSelector": LABEL_SELECTOR,
                "policyTypes": ListOf(Enum(("Ingress", "Egress"))),
                "ingress": ListOf(
                    Obj({"from": ListOf(NETWORK_POLICY_PEER), "ports": ListOf(NETWORK_POLICY_PORT)})
                ),
            },
            required=("podSelector",),
        ),
    },
    required=("apiVersion", "kind", "metadata", "spec"),
)

STRUCTURES: dict[tuple[str, str], Obj] = {
    ("networking.k8s.io/v1", "NetworkPolicy"): NETWORK_POLICY,
    ("ray.io/v1", "RayService"): RAY_SERVICE,
    ("v1", "PersistentVolumeClaim"): PVC,
    ("monitoring.coreos.com/v1", "ServiceMonitor"): SERVICE_MONITOR,
    ("monitoring.coreos.com/v1", "PodMonitor"): POD_MONITOR,
}


def problems(document: dict[str, Any]) -> list[str]:
    """Everything in `document` that its kind's structure does not allow."""
    key = (document.get("apiVersion", ""), document.get("kind", ""))
    if key not in STRUCTURES:
        return [f"no known structure for apiVersion/kind {key}"]
    return _check(document, STRUCTURES[key], document.get("kind", ""))


def _check(value: Any, structure: Any, path: str) -> list[str]:
    if structure == ANY:
        return []
    if isinstance(structure, Obj):
        return _check_object(value, structure, path)
    if isinstance(structure, ListOf):
        if not isinstance(value, list):
            return [f"{path}: expected a list"]
        return [
            p for i, item in enumerate(value) for p in _check(item, structure.item, f"{path}[{i}]")
        ]
    if isinstance(structure, MapOf):
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping"]
        return [p for k, v in value.items() for p in _check(v, structure.value, f"{path}.{k}")]
    if isinstance(structure, Enum):
        return [] if value in structure.values else [f"{path}: {value!r} not in {structure.values}"]
    return [] if _scalar_ok(value, structure) else [f"{path}: {value!r} is not a {structure}"]


def _check_object(value: Any, structure: Obj, path: str) -> list[str]:
    if not isinstance(value, dict):
        return [f"{path}: expected an object"]
    found = [
        f"{path}: missing required field {name!r}"
        for name in structure.required
        if name not in value
    ]
    for name, item in value.items():
        if name not in structure.fields:
            found.append(f"{path}.{name}: unknown field")
        else:
            found.extend(_check(item, structure.fields[name], f"{path}.{name}"))
    return found


def _scalar_ok(value: Any, kind: str) -> bool:
    if kind == STRING:
        return isinstance(value, str)
    if kind == BOOLEAN:
        return isinstance(value, bool)
    if kind == INTEGER:
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == INT_OR_STRING:
        return isinstance(value, str | int) and not isinstance(value, bool)
    if kind == QUANTITY:
        if isinstance(value, int) and not isinstance(value, bool):
            return True
        return isinstance(value, str) and bool(_QUANTITY.match(value))
    raise ValueError(f"unknown scalar kind {kind}")
