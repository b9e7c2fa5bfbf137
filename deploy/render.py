#!/usr/bin/python3
"""Renders tandem's Kubernetes manifests from deploy/values.yaml and command-line overrides.

  /usr/bin/python3 deploy/render.py [--values FILE]... [--set KEY=VALUE]... [--out DIR]

KEY is a dotted path into values.yaml (cpuNodes.poolBytes); VALUE is read as YAML, so
--set cpuNodes.hpa.enabled=false gives a boolean and --set cpuNodes.extraArgs=[--max_batch=64]
a list. A key that values.yaml does not have is an error, as is a value of the wrong kind.
Writes one object per file into DIR (default deploy/k8s) and removes the other *.yaml files
there, so DIR always holds exactly one rendering. Exit status: 0 on success, 2 on bad values.

Needs only the standard library and PyYAML (Debian's python3-yaml): run it with /usr/bin/python3.
"""

import argparse
import copy
import math
import os
import sys

import yaml

sys.dont_write_bytecode = True  # keep deploy/ free of __pycache__
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import sizes  # noqa: E402  (needs the sys.path line above)

DEPLOY_DIR = os.path.dirname(os.path.abspath(__file__))
DEFAULT_VALUES = os.path.join(DEPLOY_DIR, "values.yaml")
DEFAULT_OUT = os.path.join(DEPLOY_DIR, "k8s")

# Health-service names the binaries register (cpu_attention/node/src/server.cc,
# gpu_worker/serving/worker_server.cc). "" is the server's overall health.
CPU_NODE_HEALTH_SERVICE = "tandem.v1.CpuAttention"
GPU_WORKER_HEALTH_SERVICE = "tandem.v1.Generation"
MODELS_MOUNT = "/models"
TLS_MOUNT = "/etc/tandem/tls"
TOKENS_MOUNT = "/etc/tandem/tokens"
HEADER = "# Rendered by deploy/render.py from deploy/values.yaml: edit those, not this file.\n"


class ValuesError(Exception):
    """Bad values or overrides; the message lists every problem."""


# ---------------------------------------------------------------------------------------------
# Values: defaults, overrides, checks.


def _coerce(default, value, raw, key):
    """value (parsed from YAML) made the kind of the default, or ValuesError."""
    if isinstance(default, bool):
        if isinstance(value, bool):
            return value
        raise ValuesError(f"{key}: expected true or false, got {raw!r}")
    if isinstance(default, (int, float)):
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return value
        raise ValuesError(f"{key}: expected a number, got {raw!r}")
    if isinstance(default, str):
        if isinstance(value, (dict, list)):
            raise ValuesError(f"{key}: expected a string, got {raw!r}")
        return raw if isinstance(raw, str) else str(value)
    if isinstance(default, list):
        if isinstance(value, list):
            return value
        raise ValuesError(f"{key}: expected a list, got {raw!r}")
    if isinstance(default, dict):
        if isinstance(value, dict):
            return value
        raise ValuesError(f"{key}: expected a mapping, got {raw!r}")
    return value


def set_value(values, key, raw):
    """Applies one --set KEY=VALUE to values (in place); raw is VALUE's text."""
    parts = key.split(".")
    node = values
    for i, part in enumerate(parts):
        if not isinstance(node, dict) or part not in node:
            known = ", ".join(sorted(node)) if isinstance(node, dict) else "none"
            where = ".".join(parts[:i]) or "the top level"
            raise ValuesError(f"--set {key}: values.yaml has no key '{part}' under {where} "
                              f"(known: {known})")
        if i == len(parts) - 1:
            try:
                parsed = yaml.safe_load(raw) if raw != "" else ""
            except yaml.YAMLError as e:
                raise ValuesError(f"--set {key}: cannot read {raw!r} as YAML: {e}") from None
            node[part] = _coerce(node[part], parsed, raw, key)
        else:
            node = node[part]


def merge_values(values, overlay, prefix=""):
    """Deep-merges a --values file into values, with the same key and kind checks as --set."""
    for k, v in overlay.items():
        key = f"{prefix}{k}"
        if k not in values:
            raise ValuesError(f"--values: values.yaml has no key '{key}'")
        if isinstance(values[k], dict) and isinstance(v, dict):
            merge_values(values[k], v, key + ".")
        else:
            values[k] = _coerce(values[k], v, v, key)


def load_values(values_files=(), sets=(), defaults_path=DEFAULT_VALUES):
    """The defaults with each --values file and then each --set applied, checked."""
    with open(defaults_path, encoding="utf-8") as f:
        values = yaml.safe_load(f)
    for path in values_files:
        with open(path, encoding="utf-8") as f:
            overlay = yaml.safe_load(f) or {}
        if not isinstance(overlay, dict):
            raise ValuesError(f"--values {path}: not a mapping")
        merge_values(values, overlay)
    for item in sets:
        if "=" not in item:
            raise ValuesError(f"--set {item!r}: expected KEY=VALUE")
        key, raw = item.split("=", 1)
        set_value(values, key.strip(), raw)
    check_values(values)
    return values


def _dns_label(text):
    return (0 < len(text) <= 63 and text[0].isalnum() and text[-1].isalnum()
            and all(c.isdigit() or ("a" <= c <= "z") or c == "-" for c in text))


def check_values(v):
    """Raises ValuesError listing every value out of range."""
    problems = []

    def need_int(path, value, lo, hi=None):
        if isinstance(value, bool) or not isinstance(value, int):
            problems.append(f"{path}: expected an integer, got {value!r}")
        elif value < lo or (hi is not None and value > hi):
            limit = f"{lo}..{hi}" if hi is not None else f">= {lo}"
            problems.append(f"{path}: {value} is out of range ({limit})")

    def need_number(path, value, lo, hi):
        if not (isinstance(value, (int, float)) and math.isfinite(value) and lo <= value <= hi):
            problems.append(f"{path}: {value!r} is not a number in {lo}..{hi}")

    if not _dns_label(v["release"]) or len(v["release"]) > 40:
        problems.append(f"release: {v['release']!r} is not a DNS label of at most 40 characters")
    if not _dns_label(v["namespace"]["name"]):
        problems.append(f"namespace.name: {v['namespace']['name']!r} is not a DNS label")
    need_int("runAsUser", v["runAsUser"], 1)

    c = v["cpuNodes"]
    need_int("cpuNodes.port", c["port"], 1, 65535)
    need_int("cpuNodes.metricsPort", c["metricsPort"], 1, 65535)
    if c["metricsPort"] == c["port"]:
        problems.append("cpuNodes.metricsPort: must differ from cpuNodes.port")
    need_int("cpuNodes.replicas", c["replicas"], 0)
    need_int("cpuNodes.threads", c["threads"], 1)  # the cpu request; 0 (all cores) cannot be one
    need_int("cpuNodes.blockTokens", c["blockTokens"], 16, 256)
    need_int("cpuNodes.maxSessions", c["maxSessions"], 1)
    need_int("cpuNodes.maxSessionsPerPrincipal", c["maxSessionsPerPrincipal"], 0)
    need_int("cpuNodes.drainTimeoutS", c["drainTimeoutS"], 0)
    need_int("cpuNodes.terminationMarginS", c["terminationMarginS"], 1)
    need_int("cpuNodes.releaseFreeAfterS", c["releaseFreeAfterS"], -1, 86400)
    for key in ("poolBytes", "memoryOverheadBytes"):
        try:
            if sizes.parse_byte_size(c[key]) <= 0:
                problems.append(f"cpuNodes.{key}: must be > 0")
        except ValueError as e:
            problems.append(f"cpuNodes.{key}: {e}")
    pdb = c["pdb"]["maxUnavailable"]
    if not (isinstance(pdb, str) and pdb.endswith("%")):
        need_int("cpuNodes.pdb.maxUnavailable", pdb, 1)
    h = c["hpa"]
    need_int("cpuNodes.hpa.minReplicas", h["minReplicas"], 1)
    need_int("cpuNodes.hpa.maxReplicas", h["maxReplicas"], 1)
    if isinstance(h["minReplicas"], int) and isinstance(h["maxReplicas"], int) \
            and h["minReplicas"] > h["maxReplicas"]:
        problems.append("cpuNodes.hpa: minReplicas is above maxReplicas")
    need_int("cpuNodes.hpa.targetMemoryUtilization", h["targetMemoryUtilization"], 1, 100)
    need_int("cpuNodes.hpa.scaleUpStabilizationS", h["scaleUpStabilizationS"], 0, 3600)
    need_int("cpuNodes.hpa.scaleDownStabilizationS", h["scaleDownStabilizationS"], 0, 3600)
    need_int("cpuNodes.hpa.scaleDownPeriodS", h["scaleDownPeriodS"], 1, 1800)

    g = v["gpuWorker"]
    need_int("gpuWorker.port", g["port"], 1, 65535)
    need_int("gpuWorker.metricsPort", g["metricsPort"], 1, 65535)
    if g["metricsPort"] == g["port"]:
        problems.append("gpuWorker.metricsPort: must differ from gpuWorker.port")
    need_int("gpuWorker.replicas", g["replicas"], 0)
    need_int("gpuWorker.gpus", g["gpus"], 1)
    need_int("gpuWorker.window", g["window"], 1)
    need_int("gpuWorker.startupTimeoutS", g["startupTimeoutS"], 10)
    need_int("gpuWorker.terminationGracePeriodS", g["terminationGracePeriodS"], 1)
    need_number("gpuWorker.beta", g["beta"], 0, 1e9)
    need_number("gpuWorker.cpuNodesRefreshS", g["cpuNodesRefreshS"], 0, 86400)
    for key in ("cpu", "memory"):
        try:
            if sizes.parse_quantity(g[key]) <= 0:
                problems.append(f"gpuWorker.{key}: must be > 0")
        except ValueError as e:
            problems.append(f"gpuWorker.{key}: {e}")
    if g["mode"] not in ("gpu", "hybrid"):
        problems.append(f"gpuWorker.mode: {g['mode']!r} is not gpu or hybrid")
    if g["backend"] not in ("auto", "cpu", "cuda"):
        problems.append(f"gpuWorker.backend: {g['backend']!r} is not auto, cpu or cuda")
    if g["transport"] != "grpc":
        problems.append("gpuWorker.transport: pods do not share memory; only grpc applies")
    model_dir = g["model"]["dir"]
    if not model_dir or model_dir.startswith("/") or ".." in model_dir.split("/"):
        problems.append(f"gpuWorker.model.dir: {model_dir!r} must be a relative path under "
                        f"{MODELS_MOUNT}")
    if not _dns_label(g["model"]["pvc"]):
        problems.append(f"gpuWorker.model.pvc: {g['model']['pvc']!r} is not a valid claim name")
    t = v["tls"]
    if t["enabled"]:
        for key in ("workerSecret", "nodeSecret"):
            if not _dns_label(t[key]):
                problems.append(f"tls.{key}: {t[key]!r} is not a valid Secret name")
        for key in ("workerIdentity", "nodeServerName"):
            if not t[key] or "," in t[key] or " " in t[key]:
                problems.append(f"tls.{key}: {t[key]!r} must be one certificate name")
    if t["workerTokensSecret"] and (not t["enabled"] or not _dns_label(t["workerTokensSecret"])):
        problems.append("tls.workerTokensSecret: needs tls.enabled (a token in plaintext can be "
                        "replayed) and a valid Secret name")
    for comp in ("cpuNodes", "gpuWorker"):
        extra = v[comp]["extraArgs"]
        if not all(isinstance(a, str) and a.startswith("--") for a in extra):
            problems.append(f"{comp}.extraArgs: every item must be a string flag --name=value")
    if problems:
        raise ValuesError("\n".join(problems))


# ---------------------------------------------------------------------------------------------
# Objects.


def names(v):
    return {"cpu": f"{v['release']}-cpu-node", "gpu": f"{v['release']}-gpu-worker",
            "ns": v["namespace"]["name"]}


def selector_labels(v, component):
    return {"app.kubernetes.io/name": "tandem", "app.kubernetes.io/instance": v["release"],
            "app.kubernetes.io/component": component}


def labels(v, component):
    return {**selector_labels(v, component), "app.kubernetes.io/part-of": "tandem",
            "app.kubernetes.io/managed-by": "tandem-render"}


def metadata(v, name, component):
    return {"name": name, "namespace": names(v)["ns"], "labels": labels(v, component)}


def with_metrics(v, component_values, args, ports, pod_metadata):
    """Adds --metrics_address, the "metrics" containerPort and the scrape annotations (in
    place) when metrics.enabled."""
    if not v["metrics"]["enabled"]:
        return
    port = component_values["metricsPort"]
    after = next((i + 1 for i, a in enumerate(args) if a.startswith("--address=")), len(args))
    args.insert(after, f"--metrics_address=0.0.0.0:{port}")
    ports.append({"name": "metrics", "containerPort": port, "protocol": "TCP"})
    if v["metrics"]["annotations"]:
        pod_metadata["annotations"] = {"prometheus.io/scrape": "true",
                                       "prometheus.io/port": str(port),
                                       "prometheus.io/path": "/metrics"}


def service_ports(v, component_values):
    ports = [{"name": "grpc", "port": component_values["port"],
              "targetPort": component_values["port"], "protocol": "TCP"}]
    if v["metrics"]["enabled"]:
        ports.append({"name": "metrics", "port": component_values["metricsPort"],
                      "targetPort": component_values["metricsPort"], "protocol": "TCP"})
    return ports


def grpc_probe(v, port, service, period, failures, timeout=5):
    """A grpc.health.v1 probe; a TCP connect with TLS on (the kubelet's grpc probe has no TLS)."""
    handler = ({"tcpSocket": {"port": port}} if v["tls"]["enabled"]
               else {"grpc": {"port": port, "service": service}})
    return {**handler, "periodSeconds": period, "timeoutSeconds": timeout,
            "failureThreshold": failures}


def tls_volume(name, secret):
    return {"name": name, "secret": {"secretName": secret, "defaultMode": 0o440}}


def tls_flags(prefix):
    return [f"--{prefix}cert={TLS_MOUNT}/tls.crt", f"--{prefix}key={TLS_MOUNT}/tls.key",
            f"--{prefix}ca={TLS_MOUNT}/ca.crt"]


def pod_security(v):
    # fsGroup: Secret volumes (the TLS keys, mode 0440) are readable by the pod's group only.
    return {"runAsNonRoot": True, "runAsUser": v["runAsUser"], "runAsGroup": v["runAsUser"],
            "fsGroup": v["runAsUser"], "seccompProfile": {"type": "RuntimeDefault"}}


CONTAINER_SECURITY = {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                      "capabilities": {"drop": ["ALL"]}}


def placement(spec, component_values):
    if component_values["nodeSelector"]:
        spec["nodeSelector"] = component_values["nodeSelector"]
    if component_values["tolerations"]:
        spec["tolerations"] = component_values["tolerations"]
    return spec


def cpu_node_memory_bytes(c):
    return sizes.parse_byte_size(c["poolBytes"]) + sizes.parse_byte_size(c["memoryOverheadBytes"])


def cpu_node_service(v):
    c, n = v["cpuNodes"], names(v)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(v, n["cpu"], "cpu-node"),
        "spec": {
            # Headless: the name resolves to every ready node's pod IP (the worker's
            # --cpu_nodes_dns); a draining node fails readiness and leaves the answer.
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": selector_labels(v, "cpu-node"),
            "ports": service_ports(v, c),
        },
    }


def cpu_node_statefulset(v):
    c, n = v["cpuNodes"], names(v)
    memory = sizes.format_memory(cpu_node_memory_bytes(c))
    cpu = str(c["threads"])
    args = [f"--address=0.0.0.0:{c['port']}", f"--pool_bytes={c['poolBytes']}",
            f"--threads={c['threads']}", f"--block_tokens={c['blockTokens']}",
            f"--max_sessions={c['maxSessions']}", f"--drain_timeout_s={c['drainTimeoutS']}",
            f"--release_free_after_s={c['releaseFreeAfterS']}",
            f"--log_level={c['logLevel']}"]
    if c["maxSessionsPerPrincipal"]:
        args.append(f"--max_sessions_per_principal={c['maxSessionsPerPrincipal']}")
    if v["tls"]["enabled"]:
        # Mutual TLS; only the worker's identity may call anything but health.
        args += [*tls_flags("tls_"), f"--allowed_peers={v['tls']['workerIdentity']}"]
    args += c["extraArgs"]
    ports = [{"name": "grpc", "containerPort": c["port"], "protocol": "TCP"}]
    pod_metadata = {"labels": labels(v, "cpu-node")}
    with_metrics(v, c, args, ports, pod_metadata)
    container = {
        "name": "cpu-node",
        "image": c["image"],
        "imagePullPolicy": c["imagePullPolicy"],
        "args": args,
        "ports": ports,
        # requests == limits: Guaranteed QoS, so the node is the last to be evicted and, with
        # the kubelet's static CPU manager, gets whole cores for its attention threads.
        "resources": {"requests": {"cpu": cpu, "memory": memory},
                      "limits": {"cpu": cpu, "memory": memory}},
        "livenessProbe": grpc_probe(v, c["port"], "", period=10, failures=3),
        # The node sets tandem.v1.CpuAttention NOT_SERVING when it drains after SIGTERM while
        # it keeps serving its sessions: it leaves the Service's DNS answer, not the network.
        "readinessProbe": grpc_probe(v, c["port"], CPU_NODE_HEALTH_SERVICE, period=5,
                                     failures=2, timeout=2),
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    if v["tls"]["enabled"]:
        container["volumeMounts"] = [{"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True}]
    pod_spec = {
        "terminationGracePeriodSeconds": c["drainTimeoutS"] + c["terminationMarginS"],
        "enableServiceLinks": False,
        "securityContext": pod_security(v),
        # Spread nodes over hosts: more hosts, more memory bandwidth for attention.
        "affinity": {"podAntiAffinity": {"preferredDuringSchedulingIgnoredDuringExecution": [{
            "weight": 100,
            "podAffinityTerm": {"topologyKey": "kubernetes.io/hostname",
                                "labelSelector": {"matchLabels": selector_labels(v, "cpu-node")}},
        }]}},
        "containers": [container],
    }
    if v["tls"]["enabled"]:
        pod_spec["volumes"] = [tls_volume("tls", v["tls"]["nodeSecret"])]
    spec = {"serviceName": n["cpu"], "podManagementPolicy": "Parallel"}
    if not c["hpa"]["enabled"]:
        spec["replicas"] = c["replicas"]
    spec.update({
        "selector": {"matchLabels": selector_labels(v, "cpu-node")},
        "template": {"metadata": pod_metadata, "spec": placement(pod_spec, c)},
    })
    return {"apiVersion": "apps/v1", "kind": "StatefulSet",
            "metadata": metadata(v, n["cpu"], "cpu-node"), "spec": spec}


def cpu_node_pdb(v):
    n = names(v)
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": metadata(v, n["cpu"], "cpu-node"),
        "spec": {"maxUnavailable": v["cpuNodes"]["pdb"]["maxUnavailable"],
                 "selector": {"matchLabels": selector_labels(v, "cpu-node")}},
    }


def cpu_node_hpa(v):
    h, n = v["cpuNodes"]["hpa"], names(v)
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": metadata(v, n["cpu"], "cpu-node"),
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "StatefulSet", "name": n["cpu"]},
            "minReplicas": h["minReplicas"],
            "maxReplicas": h["maxReplicas"],
            "metrics": [{"type": "Resource", "resource": {
                "name": "memory",
                "target": {"type": "Utilization",
                           "averageUtilization": h["targetMemoryUtilization"]}}}],
            "behavior": {
                "scaleUp": {"stabilizationWindowSeconds": h["scaleUpStabilizationS"],
                            "selectPolicy": "Max",
                            "policies": [{"type": "Pods", "value": 2, "periodSeconds": 60}]},
                "scaleDown": {"stabilizationWindowSeconds": h["scaleDownStabilizationS"],
                              "selectPolicy": "Min",
                              "policies": [{"type": "Pods", "value": 1,
                                            "periodSeconds": h["scaleDownPeriodS"]}]},
            },
        },
    }


def cpu_nodes_dns(v):
    n = names(v)
    return f"{n['cpu']}.{n['ns']}.svc.cluster.local:{v['cpuNodes']['port']}"


def gpu_worker_deployment(v):
    g, n = v["gpuWorker"], names(v)
    cpu, memory = str(g["cpu"]), str(g["memory"])
    args = [f"--model={MODELS_MOUNT}/{g['model']['dir']}", f"--address=0.0.0.0:{g['port']}",
            f"--backend={g['backend']}", f"--cpu_nodes_dns={cpu_nodes_dns(v)}",
            f"--cpu_nodes_refresh_s={g['cpuNodesRefreshS']}", f"--transport={g['transport']}",
            f"--mode={g['mode']}", f"--beta={g['beta']}", f"--window={g['window']}",
            f"--log_level={g['logLevel']}"]
    t = v["tls"]
    if t["enabled"]:
        # TLS to clients (server certificate only; tokens if configured) and mutual TLS to the
        # nodes with the same certificate, checked against the nodes' certificate name.
        args += [f"--tls_cert={TLS_MOUNT}/tls.crt", f"--tls_key={TLS_MOUNT}/tls.key",
                 *tls_flags("node_tls_"), f"--node_tls_server_name={t['nodeServerName']}"]
    if t["workerTokensSecret"]:
        args.append(f"--auth_token_file={TOKENS_MOUNT}/tokens")
    args += g["extraArgs"]
    ports = [{"name": "grpc", "containerPort": g["port"], "protocol": "TCP"}]
    pod_metadata = {"labels": labels(v, "gpu-worker")}
    with_metrics(v, g, args, ports, pod_metadata)
    startup_period = 10
    container = {
        "name": "gpu-worker",
        "image": g["image"],
        "imagePullPolicy": g["imagePullPolicy"],
        "args": args,
        "ports": ports,
        "resources": {"requests": {"cpu": cpu, "memory": memory},
                      "limits": {"cpu": cpu, "memory": memory, "nvidia.com/gpu": str(g["gpus"])}},
        # The server listens only once the model is loaded: liveness waits for this.
        "startupProbe": grpc_probe(v, g["port"], "", period=startup_period,
                                   failures=-(-g["startupTimeoutS"] // startup_period)),
        "livenessProbe": grpc_probe(v, g["port"], "", period=10, failures=3),
        "readinessProbe": grpc_probe(v, g["port"], GPU_WORKER_HEALTH_SERVICE, period=5,
                                     failures=2, timeout=2),
        # The root filesystem is read-only; CUDA's JIT cache (PTX of GPUs newer than
        # TANDEM_CUDA_ARCHS) goes to a scratch volume.
        "env": [{"name": "CUDA_CACHE_PATH", "value": "/tmp/cuda-cache"}],
        "volumeMounts": [{"name": "models", "mountPath": MODELS_MOUNT, "readOnly": True},
                         {"name": "tmp", "mountPath": "/tmp"}],
        "securityContext": copy.deepcopy(CONTAINER_SECURITY),
    }
    pod_spec = {
        "terminationGracePeriodSeconds": g["terminationGracePeriodS"],
        "enableServiceLinks": False,
        "securityContext": pod_security(v),
        "containers": [container],
        "volumes": [{"name": "models", "persistentVolumeClaim": {
                         "claimName": g["model"]["pvc"], "readOnly": True}},
                    {"name": "tmp", "emptyDir": {"sizeLimit": "1Gi"}}],
    }
    if t["enabled"]:
        container["volumeMounts"].append({"name": "tls", "mountPath": TLS_MOUNT, "readOnly": True})
        pod_spec["volumes"].append(tls_volume("tls", t["workerSecret"]))
    if t["workerTokensSecret"]:
        container["volumeMounts"].append({"name": "tokens", "mountPath": TOKENS_MOUNT,
                                          "readOnly": True})
        pod_spec["volumes"].append(tls_volume("tokens", t["workerTokensSecret"]))
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": metadata(v, n["gpu"], "gpu-worker"),
        "spec": {
            "replicas": g["replicas"],
            # One GPU each: a rolling update would need a spare GPU; replace in place instead.
            "strategy": {"type": "Recreate"},
            "selector": {"matchLabels": selector_labels(v, "gpu-worker")},
            "template": {"metadata": pod_metadata, "spec": placement(pod_spec, g)},
        },
    }


def gpu_worker_service(v):
    g, n = v["gpuWorker"], names(v)
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": metadata(v, n["gpu"], "gpu-worker"),
        "spec": {
            "type": g["serviceType"],
            "selector": selector_labels(v, "gpu-worker"),
            "ports": service_ports(v, g),
        },
    }


def network_policy(v, component, ingress):
    n = names(v)
    name = n["cpu"] if component == "cpu-node" else n["gpu"]
    return {"apiVersion": "networking.k8s.io/v1", "kind": "NetworkPolicy",
            "metadata": metadata(v, name, component),
            "spec": {"podSelector": {"matchLabels": selector_labels(v, component)},
                     "policyTypes": ["Ingress"], "ingress": ingress}}


def metrics_ingress(v, component_values):
    """Prometheus scrapes from anywhere in the cluster (its namespace is not known here)."""
    if not v["metrics"]["enabled"]:
        return []
    return [{"ports": [{"port": component_values["metricsPort"], "protocol": "TCP"}]}]


def cpu_node_network_policy(v):
    c = v["cpuNodes"]
    # Only the worker pods reach the nodes' gRPC port (the kubelet's probes are not subject
    # to NetworkPolicy).
    worker_only = {"from": [{"podSelector": {"matchLabels": selector_labels(v, "gpu-worker")}}],
                   "ports": [{"port": c["port"], "protocol": "TCP"}]}
    return network_policy(v, "cpu-node", [worker_only, *metrics_ingress(v, c)])


def gpu_worker_network_policy(v):
    g = v["gpuWorker"]
    clients = {"ports": [{"port": g["port"], "protocol": "TCP"}]}
    return network_policy(v, "gpu-worker", [clients, *metrics_ingress(v, g)])


def namespace(v):
    return {"apiVersion": "v1", "kind": "Namespace",
            "metadata": {"name": v["namespace"]["name"],
                         "labels": {"app.kubernetes.io/part-of": "tandem"}}}


def objects(v):
    """{file name: object}, in the order kubectl apply -f DIR applies them (by name)."""
    out = {}
    if v["namespace"]["create"]:
        out["00-namespace.yaml"] = namespace(v)
    out["cpu-node-service.yaml"] = cpu_node_service(v)
    out["cpu-node-statefulset.yaml"] = cpu_node_statefulset(v)
    out["cpu-node-pdb.yaml"] = cpu_node_pdb(v)
    if v["cpuNodes"]["hpa"]["enabled"]:
        out["cpu-node-hpa.yaml"] = cpu_node_hpa(v)
    out["gpu-worker-service.yaml"] = gpu_worker_service(v)
    out["gpu-worker-deployment.yaml"] = gpu_worker_deployment(v)
    if v["networkPolicy"]["enabled"]:
        out["cpu-node-networkpolicy.yaml"] = cpu_node_network_policy(v)
        out["gpu-worker-networkpolicy.yaml"] = gpu_worker_network_policy(v)
    return out


# ---------------------------------------------------------------------------------------------
# YAML text.


class _Dumper(yaml.SafeDumper):
    """Block style with sequences indented under their key (yamllint's indent-sequences)."""

    def increase_indent(self, flow=False, indentless=False):
        return super().increase_indent(flow, False)

    def ignore_aliases(self, data):
        return True  # spell shared sub-objects out; anchors would confuse readers


def to_yaml(obj):
    body = yaml.dump(obj, Dumper=_Dumper, sort_keys=False, default_flow_style=False,
                     explicit_start=True, width=4096, allow_unicode=True)
    return HEADER + body


def render(values):
    """{file name: YAML text} for checked values."""
    return {name: to_yaml(obj) for name, obj in objects(copy.deepcopy(values)).items()}


def write(rendered, out_dir):
    """Writes the files and removes any other *.yaml in out_dir."""
    os.makedirs(out_dir, exist_ok=True)
    for stale in sorted(os.listdir(out_dir)):
        if stale.endswith(".yaml") and stale not in rendered:
            os.remove(os.path.join(out_dir, stale))
    for name, text in rendered.items():
        with open(os.path.join(out_dir, name), "w", encoding="utf-8") as f:
            f.write(text)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--values", action="append", default=[], metavar="FILE",
                        help="a values file merged over deploy/values.yaml (repeatable)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override one value, e.g. cpuNodes.poolBytes=64GiB (repeatable)")
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help="output directory (default: deploy/k8s)")
    args = parser.parse_args(argv)
    try:
        values = load_values(args.values, args.set)
    except ValuesError as e:
        print(f"render.py: bad values:\n{e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"render.py: {e}", file=sys.stderr)
        return 2
    rendered = render(values)
    write(rendered, args.out)
    print(f"render.py: wrote {len(rendered)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
