"""Checks Kubernetes objects against the OpenAPI models of Debian's python3-kubernetes.

Each model class in kubernetes.client.models carries openapi_types (python attribute -> type
string such as "int", "list[V1Container]", "dict(str, str)", "V1PodSpec") and attribute_map
(python attribute -> JSON field name). check_object() walks an object's dict along them:
an unknown field, a value of the wrong kind and a missing required field are each an error.
A field is required when its setter, with client-side validation on, rejects None.

Debian 12 ships python3-kubernetes 22.6 (the Kubernetes 1.22 API). Two local additions bring it
to what the manifests use, each applied only where the installed models lack it:
  * V1Probe.grpc / V1GRPCAction (GA in Kubernetes 1.27): port (int32, required), service (str).
  * autoscaling/v2 HorizontalPodAutoscaler (GA in 1.23) is checked against the V2beta2 models:
    v2 promoted v2beta2 without changing its schema.
Where the client types a field looser or stricter than the API server accepts:
  * "object" is IntOrString in every model these manifests use: an int or a string.
  * resource quantities (resources.limits/requests, emptyDir.sizeLimit) are typed str, but the
    API server also takes a YAML number (cpu: 2), so numbers are accepted there.
"""

import datetime
import difflib
import re

from kubernetes import client
from kubernetes.client import models

# (apiVersion, kind) -> model classes to try, first found wins.
KINDS = {
    ("v1", "Namespace"): ("V1Namespace",),
    ("v1", "Service"): ("V1Service",),
    ("v1", "ConfigMap"): ("V1ConfigMap",),
    ("v1", "ServiceAccount"): ("V1ServiceAccount",),
    ("v1", "PersistentVolumeClaim"): ("V1PersistentVolumeClaim",),
    ("apps/v1", "StatefulSet"): ("V1StatefulSet",),
    ("apps/v1", "Deployment"): ("V1Deployment",),
    ("policy/v1", "PodDisruptionBudget"): ("V1PodDisruptionBudget",),
    ("networking.k8s.io/v1", "NetworkPolicy"): ("V1NetworkPolicy",),
    ("autoscaling/v2", "HorizontalPodAutoscaler"): ("V2HorizontalPodAutoscaler",
                                                     "V2beta2HorizontalPodAutoscaler"),
}

# Local models: name -> {json field: (type, required)}.
LOCAL_MODELS = {
    "V1GRPCAction": {"port": ("int", True), "service": ("str", False)},
}
# Local fields added to installed models that lack them: model -> {json field: type}.
LOCAL_FIELDS = {
    "V1Probe": {"grpc": "V1GRPCAction"},
}
# Fields typed str by the client that the API server reads as a Quantity (string or number).
QUANTITY_FIELDS = {
    ("V1ResourceRequirements", "limits"), ("V1ResourceRequirements", "requests"),
    ("V1EmptyDirVolumeSource", "sizeLimit"),
}

_LIST = re.compile(r"^list\[(.+)\]$")
_DICT = re.compile(r"^dict\(([^,]+), (.+)\)$")
_PRIMITIVES = {"str", "int", "float", "bool", "object", "date", "datetime"}


class _Schema:
    """One model's fields: json name -> (python attribute or None, type), required names."""

    def __init__(self, name, fields, required, cls=None):
        self.name, self.fields, self.required, self.cls = name, fields, required, cls


_cache = {}
_config = None


def _validating_config():
    global _config
    if _config is None:
        _config = client.Configuration()
        _config.client_side_validation = True
    return _config


def schema(name):
    """The _Schema of a model name; KeyError when neither the client nor LOCAL_MODELS has it."""
    if name in _cache:
        return _cache[name]
    cls = getattr(models, name, None)
    if cls is not None and hasattr(cls, "openapi_types"):
        fields, required = {}, set()
        probe = cls.__new__(cls)  # no __init__: it would reject the missing required fields
        probe.local_vars_configuration = _validating_config()
        for attr, type_name in cls.openapi_types.items():
            json_name = cls.attribute_map[attr]
            fields[json_name] = (attr, type_name)
            try:
                getattr(cls, attr).fset(probe, None)
            except ValueError as e:
                if "must not be `None`" in str(e):
                    required.add(json_name)
        for json_name, type_name in LOCAL_FIELDS.get(name, {}).items():
            fields.setdefault(json_name, (None, type_name))
        result = _Schema(name, fields, required, cls)
    elif name in LOCAL_MODELS:
        spec = LOCAL_MODELS[name]
        result = _Schema(name, {k: (None, t) for k, (t, _) in spec.items()},
                         {k for k, (_, req) in spec.items() if req})
    else:
        raise KeyError(name)
    _cache[name] = result
    return result


def model_for(api_version, kind):
    """The model name checking (apiVersion, kind), or None when none is known."""
    if not isinstance(api_version, str) or not isinstance(kind, str):
        return None
    for name in KINDS.get((api_version, kind), ()):
        if getattr(models, name, None) is not None:
            return name
    return None


def _kind_name(value):
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


def _check_primitive(value, type_name, path, quantity, errors):
    ok = {
        "str": isinstance(value, str) or (quantity and isinstance(value, (int, float))
                                          and not isinstance(value, bool)),
        "int": isinstance(value, int) and not isinstance(value, bool),
        "float": isinstance(value, (int, float)) and not isinstance(value, bool),
        "bool": isinstance(value, bool),
        "object": isinstance(value, (int, str)) and not isinstance(value, bool),
        "date": isinstance(value, (str, datetime.date)),
        "datetime": isinstance(value, (str, datetime.datetime)),
    }[type_name]
    if not ok:
        expected = {"str": "string", "object": "int or string"}.get(type_name, type_name)
        errors.append(f"{path}: expected {expected}, got {_kind_name(value)} ({value!r})")
    return ok


def _walk(value, type_name, path, errors, quantity=False):
    m = _LIST.match(type_name)
    if m:
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {_kind_name(value)}")
            return
        for i, item in enumerate(value):
            _walk(item, m.group(1), f"{path}[{i}]", errors, quantity)
        return
    m = _DICT.match(type_name)
    if m:
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a mapping, got {_kind_name(value)}")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(f"{path}: key {key!r} is not a string")
            _walk(item, m.group(2), f"{path}.{key}", errors, quantity)
        return
    if type_name in _PRIMITIVES:
        _check_primitive(value, type_name, path, quantity, errors)
        return
    _walk_model(value, type_name, path, errors)


def _walk_model(value, model_name, path, errors):
    try:
        s = schema(model_name)
    except KeyError:
        errors.append(f"{path}: no schema for model {model_name}")
        return
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a mapping ({model_name}), got {_kind_name(value)}")
        return
    for key in sorted(s.required):
        if value.get(key) is None:
            errors.append(f"{path}: missing required field '{key}' ({model_name})")
    for key, item in value.items():
        if key not in s.fields:
            near = difflib.get_close_matches(str(key), s.fields, n=1)
            hint = f"; did you mean '{near[0]}'?" if near else ""
            errors.append(f"{path}: unknown field '{key}' in {model_name}{hint}")
            continue
        if item is None:  # an explicit null is the field left unset
            continue
        attr, type_name = s.fields[key]
        child = f"{path}.{key}" if path else key
        before = len(errors)
        _walk(item, type_name, child, errors, (model_name, key) in QUANTITY_FIELDS)
        # Primitive values that type-check also go through the model's own setter, which
        # enforces the few patterns and enums the client knows.
        if (len(errors) == before and attr is not None and type_name in _PRIMITIVES
                and s.cls is not None):
            probe = s.cls.__new__(s.cls)
            probe.local_vars_configuration = _validating_config()
            try:
                getattr(s.cls, attr).fset(probe, item)
            except ValueError as e:
                errors.append(f"{child}: {e}")


def check_object(obj):
    """Errors (strings, each naming the field path) of one manifest object."""
    if not isinstance(obj, dict):
        return [f"a manifest document must be a mapping, got {_kind_name(obj)}"]
    api_version, kind = obj.get("apiVersion"), obj.get("kind")
    model_name = model_for(api_version, kind)
    if model_name is None:
        known = ", ".join(f"{a} {k}" for a, k in sorted(KINDS))
        return [f"no schema for apiVersion {api_version!r} kind {kind!r} (known: {known})"]
    errors = []
    _walk_model(obj, model_name, "", errors)
    return [e[2:] if e.startswith(": ") else e for e in errors]
