"""Compose a kustomization in Python: the subset of kustomize that k8s/ uses.

CI needs no kustomize binary to test what `kubectl apply -k k8s/overlays/...` would send.
Supported: `resources` (YAML files, or directories holding a kustomization.yaml),
`namespace`, and `patches` whose file is a JSON 6902 patch (a YAML list of add / replace /
remove operations) applied to the resources its `target` selects. Any other key raises, so
a kustomization that grows a feature this composer lacks fails loudly instead of being
half-applied; test_manifests.py also compares the result with `kubectl kustomize` where
kubectl is installed.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

Resource = dict[str, Any]

_KNOWN_KEYS = {"apiVersion", "kind", "resources", "patches", "namespace"}
_TARGET_KEYS = {"group", "version", "kind", "name"}


class KustomizeError(ValueError):
    """The kustomization uses something this composer does not implement, or is wrong."""


def build(directory: Path) -> list[Resource]:
    """The resources `kubectl kustomize DIRECTORY` would print, in file order."""
    spec = _load_kustomization(directory)
    resources: list[Resource] = []
    for entry in spec.get("resources", []):
        path = directory / entry
        resources.extend(build(path) if path.is_dir() else load_documents(path))
    for patch in spec.get("patches", []):
        _apply_patch(resources, directory, patch)
    if "namespace" in spec:
        for resource in resources:
            resource.setdefault("metadata", {})["namespace"] = spec["namespace"]
    return resources


def load_documents(path: Path) -> list[Resource]:
    """Every non-empty YAML document of a file; each must be a mapping."""
    documents = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
    for document in documents:
        if not isinstance(document, dict):
            raise KustomizeError(f"{path}: a document is not a mapping")
    return documents


def _load_kustomization(directory: Path) -> dict[str, Any]:
    spec = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(spec) - _KNOWN_KEYS
    if unknown:
        raise KustomizeError(f"{directory}: unsupported kustomization keys {sorted(unknown)}")
    if spec.get("kind") != "Kustomization":
        raise KustomizeError(f"{directory}: kind must be Kustomization")
    return spec


def _apply_patch(resources: list[Resource], directory: Path, patch: dict[str, Any]) -> None:
    if set(patch) != {"path", "target"}:
        raise KustomizeError(f"{directory}: a patch needs exactly `path` and `target`")
    target = patch["target"]
    if not set(target) <= _TARGET_KEYS:
        raise KustomizeError(f"{directory}: unsupported target keys {sorted(target)}")
    operations = yaml.safe_load((directory / patch["path"]).read_text())
    if not isinstance(operations, list):
        raise KustomizeError(f"{directory / patch['path']}: only JSON 6902 patches are supported")
    selected = [r for r in resources if _matches(r, target)]
    if not selected:
        raise KustomizeError(f"{directory / patch['path']}: its target matches no resource")
    for resource in selected:
        for operation in operations:
            apply_operation(resource, operation)


def _matches(resource: Resource, target: dict[str, str]) -> bool:
    group, _, version = resource.get("apiVersion", "").rpartition("/")
    actual = {
        "group": group,
        "version": version,
        "kind": resource.get("kind"),
        "name": resource.get("metadata", {}).get("name"),
    }
    return all(actual[key] == value for key, value in target.items())


def apply_operation(document: Resource, operation: dict[str, Any]) -> None:
    """One RFC 6902 operation (add, replace or remove) on `document`, in place."""
    op, path = operation.get("op"), operation.get("path")
    if op not in {"add", "replace", "remove"} or not isinstance(path, str):
        raise KustomizeError(f"unsupported JSON patch operation {operation}")
    *parents, last = _pointer(path)
    container: Any = document
    for token in parents:
        container = container[_index(container, token, path)]
    if isinstance(container, list):
        _apply_to_list(container, op, last, operation, path)
    elif isinstance(container, dict):
        _apply_to_dict(container, op, last, operation, path)
    else:
        raise KustomizeError(f"{path}: parent is neither an object nor a list")


def _apply_to_dict(
    container: dict[str, Any], op: str, key: str, operation: dict[str, Any], path: str
) -> None:
    if op != "add" and key not in container:
        raise KustomizeError(f"{path}: cannot {op} a missing member")
    if op == "remove":
        del container[key]
    else:
        container[key] = copy.deepcopy(operation["value"])


def _apply_to_list(
    container: list[Any], op: str, token: str, operation: dict[str, Any], path: str
) -> None:
    if op == "add" and token == "-":
        container.append(copy.deepcopy(operation["value"]))
        return
    index = _index(container, token, path, allow_end=op == "add")
    if op == "add":
        container.insert(index, copy.deepcopy(operation["value"]))
    elif op == "replace":
        container[index] = copy.deepcopy(operation["value"])
    else:
        del container[index]


def _pointer(path: str) -> list[str]:
    """RFC 6901: '/a/b~1c' -> ['a', 'b/c']."""
    if not path.startswith("/"):
        raise KustomizeError(f"{path}: a JSON pointer starts with '/'")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _index(container: Any, token: str, path: str, allow_end: bool = False) -> Any:
    if isinstance(container, dict):
        if token not in container:
            raise KustomizeError(f"{path}: no member {token!r}")
        return token
    if not isinstance(container, list) or not token.isdigit():
        raise KustomizeError(f"{path}: {token!r} does not index a list")
    index = int(token)
    if index > len(container) or (index == len(container) and not allow_end):
        raise KustomizeError(f"{path}: index {index} is out of range")
    return index
