"""Schemas for the launch specs scripts/launch_specs.py writes, and a small validator.

JOBSET: the fields of the JobSet CRD (jobset.x-k8s.io/v1alpha2) and of the batch/v1 Job and
core/v1 Pod specs that the manifest uses, written from their documented API reference (types,
required fields, enums, bounds); unknown fields are refused where the API has a fixed set.
SKY_TASK: the top-level fields of a SkyPilot task YAML and its `resources`, from SkyPilot's
YAML spec. The validator covers the JSON-Schema keywords used here (type, required,
properties, additionalProperties, items, enum, minimum, pattern): no dependency needed.
"""

from __future__ import annotations

import re
from typing import Any

NAME = {"type": "string", "pattern": r"^[a-z]([-a-z0-9]*[a-z0-9])?$"}
ENV_VAR = {"type": "object", "required": ["name"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "value": {"type": "string"},
    "valueFrom": {"type": "object", "properties": {"secretKeyRef": {
        "type": "object", "required": ["name", "key"],
        "properties": {"name": NAME, "key": {"type": "string"}}}}}}}
CONTAINER = {"type": "object", "required": ["name", "image"], "properties": {
    "name": NAME, "image": {"type": "string"}, "workingDir": {"type": "string"},
    "command": {"type": "array", "items": {"type": "string"}},
    "env": {"type": "array", "items": ENV_VAR},
    "resources": {"type": "object", "properties": {
        "limits": {"type": "object"}, "requests": {"type": "object"}}},
    "volumeMounts": {"type": "array", "items": {"type": "object", "required": ["name",
                                                                            "mountPath"]}}}}
POD_SPEC = {"type": "object", "required": ["containers"], "properties": {
    "restartPolicy": {"enum": ["Always", "OnFailure", "Never"]},
    "containers": {"type": "array", "items": CONTAINER},
    "volumes": {"type": "array", "items": {"type": "object", "required": ["name"]}},
    "subdomain": {"type": "string"}}}
JOB_SPEC = {"type": "object", "required": ["template"], "properties": {
    "parallelism": {"type": "integer", "minimum": 0},
    "completions": {"type": "integer", "minimum": 0},
    "completionMode": {"enum": ["NonIndexed", "Indexed"]},
    "backoffLimit": {"type": "integer", "minimum": 0},
    "template": {"type": "object", "required": ["spec"], "properties": {"spec": POD_SPEC}}}}
JOBSET = {"type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
          "properties": {
    "apiVersion": {"enum": ["jobset.x-k8s.io/v1alpha2"]}, "kind": {"enum": ["JobSet"]},
    "metadata": {"type": "object", "required": ["name"], "properties": {"name": NAME}},
    "spec": {"type": "object", "required": ["replicatedJobs"], "additionalProperties": False,
             "properties": {
        "network": {"type": "object", "additionalProperties": False, "properties": {
            "enableDNSHostnames": {"type": "boolean"}, "subdomain": {"type": "string"},
            "publishNotReadyAddresses": {"type": "boolean"}}},
        "failurePolicy": {"type": "object", "properties": {
            "maxRestarts": {"type": "integer", "minimum": 0}}},
        "successPolicy": {"type": "object"}, "startupPolicy": {"type": "object"},
        "suspend": {"type": "boolean"}, "ttlSecondsAfterFinished": {"type": "integer"},
        "replicatedJobs": {"type": "array", "items": {
            "type": "object", "required": ["name", "template"], "additionalProperties": False,
            "properties": {"name": NAME, "replicas": {"type": "integer", "minimum": 0},
                           "template": {"type": "object", "required": ["spec"],
                                        "properties": {"spec": JOB_SPEC}}}}}}}}}
SKY_TASK = {"type": "object", "required": ["run"], "additionalProperties": False, "properties": {
    "name": {"type": "string"}, "workdir": {"type": "string"},
    "num_nodes": {"type": "integer", "minimum": 1},
    "resources": {"type": "object", "additionalProperties": False, "properties": {
        "accelerators": {"type": "string", "pattern": r"^[A-Za-z0-9-]+(:\d+)?$"},
        "use_spot": {"type": "boolean"}, "cloud": {"type": "string"},
        "region": {"type": "string"}, "job_recovery": {"type": "object"}}},
    "envs": {"type": "object"}, "file_mounts": {"type": "object"},
    "setup": {"type": "string"}, "run": {"type": "string"}}}

_TYPES = {"object": dict, "array": list, "string": str, "boolean": bool}


def errors(value: Any, schema: dict[str, Any], where: str = "$") -> list[str]:
    """Every place `value` breaks `schema`, as `path: what`."""
    out: list[str] = []
    kind = schema.get("type")
    if kind == "integer":
        if not isinstance(value, int) or isinstance(value, bool):
            return [f"{where}: expected an integer, got {value!r}"]
    elif kind is not None and not isinstance(value, _TYPES[kind]):
        return [f"{where}: expected {kind}, got {type(value).__name__}"]
    if "enum" in schema and value not in schema["enum"]:
        out.append(f"{where}: {value!r} not one of {schema['enum']}")
    if "minimum" in schema and value < schema["minimum"]:
        out.append(f"{where}: {value} < {schema['minimum']}")
    if "pattern" in schema and not re.search(schema["pattern"], value):
        out.append(f"{where}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, dict):
        props = schema.get("properties", {})
        out += [f"{where}: {k} is required" for k in schema.get("required", []) if k not in value]
        for k, v in value.items():
            if k in props:
                out += errors(v, props[k], f"{where}.{k}")
            elif schema.get("additionalProperties") is False:
                out.append(f"{where}: unknown field {k}")
    if isinstance(value, list) and "items" in schema:
        for i, v in enumerate(value):
            out += errors(v, schema["items"], f"{where}[{i}]")
    return out
