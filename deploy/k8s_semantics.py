"""Cross-object checks of tandem's manifests: what the OpenAPI schema cannot see.

check(entries, complete) takes every object of one manifest set (entries: list of (source,
object) with source like "k8s/cpu-node-statefulset.yaml") and returns error strings:
  * a StatefulSet's serviceName names a headless Service (clusterIP: None, not publishing
    not-ready addresses) in its namespace whose selector matches the pod labels;
  * every Service, PodDisruptionBudget and HPA selects or targets a workload of the set;
  * every probe is a grpc probe on a port of its container; the readiness probe asks for the
    component's service (tandem.v1.CpuAttention / tandem.v1.Generation); a container serving
    TLS (--tls_cert) has TCP probes instead (the kubelet's grpc probe cannot speak TLS);
  * a CPU node with --tls_ca names --allowed_peers (else any certificate of the CA may read
    every session's KV), and --allowed_peers without --tls_ca is an error (nothing to check);
  * a CPU node's memory request is at least its --pool_bytes and its grace period outlasts
    --drain_timeout_s; a worker requests nvidia.com/gpu and its --cpu_nodes_dns names the
    headless Service of a CPU-node StatefulSet, and its port;
  * a container's --metrics_address serves on a containerPort other than --address's; pods
    annotated prometheus.io/scrape: "true" name in prometheus.io/port the port of a
    container's --metrics_address and in prometheus.io/path (if set) /metrics;
  * with complete=True, the set holds a CPU-node StatefulSet, a worker and a PDB.
Objects that fail the schema check may be partial; every lookup here tolerates that.
"""

import re

import sizes

CPU_NODE_SERVICE = "tandem.v1.CpuAttention"
GPU_WORKER_SERVICE = "tandem.v1.Generation"
POOL_BYTES_DEFAULT = 8 << 30  # --pool_bytes default in services/cpu_attention_main.cc
_DNS = re.compile(r"^([a-z0-9-]+)\.([a-z0-9-]+)\.svc\.cluster\.local:([0-9]+)$")
WORKLOAD_KINDS = ("StatefulSet", "Deployment")


def _get(obj, *path, default=None, kind=None):
    """obj[path[0]][path[1]]...; default when a step is missing or the value is not of kind.

    Objects that fail the schema check reach here too, so every access goes through this.
    """
    for key in path:
        if not isinstance(obj, dict) or key not in obj:
            return default
        obj = obj[key]
    if obj is None or (kind is not None and not isinstance(obj, kind)):
        return default
    return obj


def _str(obj, *path):
    return _get(obj, *path, kind=str)


def _dicts(obj, *path):
    """The dict items of a list field (non-dicts skipped)."""
    return [x for x in _get(obj, *path, default=[], kind=list) if isinstance(x, dict)]


def _name(obj):
    return f"{_str(obj, 'kind') or '?'}/{_str(obj, 'metadata', 'name') or '?'}"


def _ns(obj):
    return _str(obj, "metadata", "namespace") or "default"


def _ints(values):
    return sorted(v for v in values if isinstance(v, int) and not isinstance(v, bool))


def selector_matches(selector, labels):
    """True when a LabelSelector (matchLabels and matchExpressions) selects these labels.

    An empty or missing selector selects nothing here: tandem's objects always name labels.
    """
    if not isinstance(selector, dict) or not isinstance(labels, dict):
        return False
    match_labels = _get(selector, "matchLabels", default={}, kind=dict)
    expressions = _get(selector, "matchExpressions", default=[], kind=list)
    if not match_labels and not expressions:
        return False
    if any(labels.get(k) != v for k, v in match_labels.items()):
        return False
    for e in expressions:
        if not isinstance(e, dict):
            return False
        key, op = e.get("key"), e.get("operator")
        vals = _get(e, "values", default=[], kind=list)
        if not isinstance(key, str):
            return False
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and key in labels and labels[key] in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _service_selects(service_selector, labels):
    """A Service's selector is a plain map; empty selects nothing (endpoints managed by hand)."""
    return (isinstance(service_selector, dict) and bool(service_selector)
            and isinstance(labels, dict)
            and all(labels.get(k) == v for k, v in service_selector.items()))


def flags(container):
    """{flag name: value} of a container's --name=value args (a bare --name gives "")."""
    out = {}
    for arg in (_get(container, "command", default=[], kind=list)
                + _get(container, "args", default=[], kind=list)):
        if isinstance(arg, str) and arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            out[name] = value
    return out


def role(container):
    """"cpu-node", "gpu-worker" or None, from the flags only a CPU node / a worker takes."""
    f = flags(container)
    if "pool_bytes" in f or "drain_timeout_s" in f:
        return "cpu-node"
    if "model" in f or "cpu_nodes_dns" in f or "cpu_nodes" in f:
        return "gpu-worker"
    return None


def container_ports(container):
    return {p.get("containerPort") for p in _dicts(container, "ports")
            if isinstance(p.get("containerPort"), int)}


def _address_port(address):
    host, _, port = address.rpartition(":")
    return int(port) if host and port.isdigit() else None


def _check_tls_probe(where, probe_name, probe, ports, errors):
    others = [k for k in ("grpc", "httpGet", "exec") if k in probe]
    tcp = probe.get("tcpSocket")
    if others or not isinstance(tcp, dict):
        kind = others[0] if others else "no handler"
        errors.append(f"{where}: {probe_name} is not a tcpSocket probe ({kind}); the container "
                      f"serves TLS (--tls_cert) and the kubelet's grpc probe cannot speak TLS")
        return
    port = tcp.get("port")
    if isinstance(port, int) and not isinstance(port, bool) and port not in ports:
        errors.append(f"{where}: {probe_name} tcpSocket port {port} is not a "
                      f"containerPort of the container ({_ints(ports)})")


def _check_probes(where, container, errors):
    ports = container_ports(container)
    tls = "tls_cert" in flags(container)
    expected_ready = {"cpu-node": CPU_NODE_SERVICE, "gpu-worker": GPU_WORKER_SERVICE}.get(
        role(container))
    for probe_name in ("livenessProbe", "readinessProbe"):
        if _get(container, probe_name) is None:
            errors.append(f"{where}: has no {probe_name} (tandem needs a grpc liveness and "
                          f"readiness probe on every container)")
    for probe_name in ("livenessProbe", "readinessProbe", "startupProbe"):
        probe = _get(container, probe_name, kind=dict)
        if probe is None:
            continue  # missing (reported above) or not a mapping (the schema check's)
        if tls:
            _check_tls_probe(where, probe_name, probe, ports, errors)
            continue
        others = [k for k in ("httpGet", "tcpSocket", "exec") if k in probe]
        grpc = probe.get("grpc")
        if others or not isinstance(grpc, dict):
            kind = others[0] if others else "no handler"
            errors.append(f"{where}: {probe_name} is not a grpc probe ({kind}); tandem's "
                          f"servers answer grpc.health.v1 on their serving port")
            continue
        port = grpc.get("port")
        # A port that is missing or not an int is the schema check's to report.
        if isinstance(port, int) and not isinstance(port, bool) and port not in ports:
            errors.append(f"{where}: {probe_name} grpc port {port} is not a "
                          f"containerPort of the container ({_ints(ports)})")
        service = grpc.get("service") if isinstance(grpc.get("service"), str) else ""
        if probe_name == "readinessProbe" and expected_ready and service != expected_ready:
            errors.append(f"{where}: readinessProbe asks for service {service!r}; it must be "
                          f"{expected_ready!r} (the one a draining server turns NOT_SERVING)")
        if probe_name in ("livenessProbe", "startupProbe") and service != "":
            errors.append(f"{where}: {probe_name} asks for service {service!r}; liveness is the "
                          f"overall health, service \"\"")


def _memory_request(where, container, errors):
    value = _get(container, "resources", "requests", "memory", kind=(str, int, float))
    if value is None:  # requests default to limits
        value = _get(container, "resources", "limits", "memory", kind=(str, int, float))
    if value is None:
        return None
    try:
        return sizes.parse_quantity(value)
    except ValueError as e:
        errors.append(f"{where}: memory request: {e}")
        return None


def _check_cpu_node(where, pod_spec, container, errors):
    f = flags(container)
    pool = POOL_BYTES_DEFAULT
    if "pool_bytes" in f:
        try:
            pool = sizes.parse_byte_size(f["pool_bytes"])
        except ValueError as e:
            errors.append(f"{where}: --pool_bytes: {e}")
    memory = _memory_request(where, container, errors)
    if memory is None:
        errors.append(f"{where}: has no memory request; it must cover --pool_bytes "
                      f"({sizes.format_gib(pool)}) plus overhead")
    elif memory < pool:
        errors.append(f"{where}: memory request ({sizes.format_gib(memory)}) is below "
                      f"--pool_bytes={f.get('pool_bytes', '8GiB')} ({sizes.format_gib(pool)}); "
                      f"the node would be OOM-killed as its pool fills")
    limit = _get(container, "resources", "limits", "memory", kind=(str, int, float))
    if memory is not None and limit is not None:
        try:
            if sizes.parse_quantity(limit) < memory:
                errors.append(f"{where}: memory limit {limit} is below the request")
        except ValueError as e:
            errors.append(f"{where}: memory limit: {e}")
    if "drain_timeout_s" in f:
        grace = _get(pod_spec, "terminationGracePeriodSeconds", default=30)
        try:
            drain = float(f["drain_timeout_s"])
        except ValueError:
            errors.append(f"{where}: --drain_timeout_s={f['drain_timeout_s']} is not a number")
        else:
            if not isinstance(grace, int) or grace <= drain:
                errors.append(f"{where}: terminationGracePeriodSeconds {grace} must exceed "
                              f"--drain_timeout_s={f['drain_timeout_s']}, or the kubelet kills "
                              f"the node mid-drain")


def _check_worker(where, container, entries, errors):
    gpus = _get(container, "resources", "limits", "nvidia.com/gpu")
    try:
        gpu_count = int(gpus) if gpus is not None else 0
    except (TypeError, ValueError):
        gpu_count = 0
    if gpu_count < 1:
        errors.append(f"{where}: does not request nvidia.com/gpu in resources.limits")
    f = flags(container)
    dns = f.get("cpu_nodes_dns")
    if not dns:
        errors.append(f"{where}: has no --cpu_nodes_dns naming the CPU nodes' headless Service")
        return
    m = _DNS.match(dns)
    if m is None:
        errors.append(f"{where}: --cpu_nodes_dns={dns} is not "
                      f"<service>.<namespace>.svc.cluster.local:<port>")
        return
    svc_name, svc_ns, port = m.group(1), m.group(2), int(m.group(3))
    headless = {(_ns(o), _str(o, "spec", "serviceName")): o
                for _, o in entries if o.get("kind") == "StatefulSet"}
    sts = headless.get((svc_ns, svc_name))
    service = _find(entries, "Service", svc_ns, svc_name)
    if sts is None or service is None or _get(service, "spec", "clusterIP") != "None":
        errors.append(f"{where}: --cpu_nodes_dns={dns} names no headless Service of a CPU-node "
                      f"StatefulSet in namespace {svc_ns}")
        return
    service_ports = {p.get("port") for p in _dicts(service, "spec", "ports")
                     if isinstance(p.get("port"), int)}
    node_ports = set()
    for c in _dicts(sts, "spec", "template", "spec", "containers"):
        node_ports |= container_ports(c)
    if port not in service_ports or port not in node_ports:
        errors.append(f"{where}: --cpu_nodes_dns port {port} is not the port of Service "
                      f"{svc_name} ({_ints(service_ports)}) and of its pods "
                      f"({_ints(node_ports)}); a headless name reaches pod "
                      f"IPs directly, so the two must be equal")


def _check_metrics(where, pod_metadata, containers, errors):
    metrics_ports = set()
    for c in containers:
        cwhere = f"{where} container {_str(c, 'name') or '?'}"
        f = flags(c)
        if "metrics_address" not in f:
            continue
        port = _address_port(f["metrics_address"])
        if port is None:
            errors.append(f"{cwhere}: --metrics_address={f['metrics_address']} is not host:port")
            continue
        metrics_ports.add(port)
        if port not in container_ports(c):
            errors.append(f"{cwhere}: --metrics_address={f['metrics_address']} does not serve on "
                          f"a containerPort ({_ints(container_ports(c))})")
        if "address" in f and _address_port(f["address"]) == port:
            errors.append(f"{cwhere}: --metrics_address and --address share port {port}")
    annotations = _get(pod_metadata, "annotations", default={}, kind=dict)
    if annotations.get("prometheus.io/scrape") != "true":
        return
    port = annotations.get("prometheus.io/port")
    if not (isinstance(port, str) and port.isdigit() and int(port) in metrics_ports):
        errors.append(f"{where}: pod annotation prometheus.io/port {port!r} is not the port of a "
                      f"container's --metrics_address ({_ints(metrics_ports)}); Prometheus would "
                      f"scrape a port that serves no /metrics")
    path = annotations.get("prometheus.io/path", "/metrics")
    if path != "/metrics":
        errors.append(f"{where}: pod annotation prometheus.io/path {path!r}: tandem serves "
                      f"/metrics")


def _find(entries, kind, namespace, name):
    for _, o in entries:
        if o.get("kind") == kind and _ns(o) == namespace and _str(o, "metadata", "name") == name:
            return o
    return None


def _check_statefulset(where, sts, entries, errors):
    ns = _ns(sts)
    pod_labels = _get(sts, "spec", "template", "metadata", "labels", default={}, kind=dict)
    service_name = _str(sts, "spec", "serviceName")
    service = _find(entries, "Service", ns, service_name) if service_name else None
    if service is None or _get(service, "spec", "clusterIP") != "None":
        what = "is not headless (clusterIP: None)" if service is not None else "does not exist"
        errors.append(f"{where}: serviceName {service_name!r} names no headless Service in "
                      f"namespace {ns} (Service {service_name!r} {what})")
    else:
        if not _service_selects(_get(service, "spec", "selector"), pod_labels):
            errors.append(f"{where}: headless Service {service_name} selector "
                          f"{_get(service, 'spec', 'selector')} does not match the pod labels "
                          f"{pod_labels}")
        if _get(service, "spec", "publishNotReadyAddresses", default=False):
            errors.append(f"{where}: headless Service {service_name} publishes not-ready "
                          f"addresses, so a draining node would stay in the worker's DNS answer")
    if _get(sts, "spec", "podManagementPolicy") != "Parallel":
        errors.append(f"{where}: podManagementPolicy must be Parallel (nodes are independent; "
                      f"OrderedReady starts and stops them one at a time)")


def _check_selectors(entries, errors):
    workloads = [o for _, o in entries if o.get("kind") in WORKLOAD_KINDS]

    def pods(o):
        return _get(o, "spec", "template", "metadata", "labels", default={}, kind=dict)

    for source, o in entries:
        where = f"{source}: {_name(o)}"
        kind, ns = o.get("kind"), _ns(o)
        if kind in WORKLOAD_KINDS and not selector_matches(_get(o, "spec", "selector"), pods(o)):
            errors.append(f"{where}: spec.selector does not match the pod template's labels")
        if kind == "Service" and _get(o, "spec", "selector"):
            if not any(_ns(w) == ns and _service_selects(_get(o, "spec", "selector"), pods(w))
                       for w in workloads):
                errors.append(f"{where}: selector {_get(o, 'spec', 'selector')} matches the "
                              f"pods of no workload in namespace {ns}")
        if kind == "PodDisruptionBudget":
            selected = [w for w in workloads if _ns(w) == ns and w.get("kind") == "StatefulSet"
                        and selector_matches(_get(o, "spec", "selector"), pods(w))]
            if not selected:
                errors.append(f"{where}: selector selects the pods of no StatefulSet in "
                              f"namespace {ns}")
        if kind == "HorizontalPodAutoscaler":
            ref = _get(o, "spec", "scaleTargetRef", default={}, kind=dict)
            target = _find(entries, ref.get("kind"), ns, ref.get("name"))
            if target is None or ref.get("kind") not in WORKLOAD_KINDS \
                    or ref.get("apiVersion") != "apps/v1":
                errors.append(f"{where}: scaleTargetRef {ref} names no apps/v1 StatefulSet or "
                              f"Deployment in namespace {ns}")
            elif _get(target, "spec", "replicas") is not None:
                errors.append(f"{where}: its target {_name(target)} sets spec.replicas; every "
                              f"kubectl apply would reset the autoscaler's choice")
            if _get(o, "spec", "behavior", "scaleDown", "stabilizationWindowSeconds") is None:
                errors.append(f"{where}: has no behavior.scaleDown.stabilizationWindowSeconds; "
                              f"CPU nodes hold KV and must scale down slowly")


def _check_node_peers(where, container, errors):
    f = flags(container)
    if "tls_ca" in f and not f.get("allowed_peers"):
        errors.append(f"{where}: --tls_ca without --allowed_peers lets any certificate of the CA "
                      f"read and change every session's KV; name the worker's identity")
    if f.get("allowed_peers") and "tls_ca" not in f:
        errors.append(f"{where}: --allowed_peers needs --tls_ca (mutual TLS): without client "
                      f"certificates the node refuses to start")


def check(entries, complete=False):
    """Error strings for a manifest set; entries: list of (source, object dict)."""
    errors = []
    entries = [(s, o) for s, o in entries if isinstance(o, dict)]
    seen = {}
    for source, o in entries:
        key = (_str(o, "kind"), _ns(o), _str(o, "metadata", "name"))
        if key[2] is None:
            errors.append(f"{source}: {o.get('kind')} has no metadata.name")
        elif key in seen:
            errors.append(f"{source}: {_name(o)} is also defined in {seen[key]}")
        else:
            seen[key] = source
    _check_selectors(entries, errors)
    roles = set()
    for source, o in entries:
        if o.get("kind") not in WORKLOAD_KINDS:
            continue
        where = f"{source}: {_name(o)}"
        if o.get("kind") == "StatefulSet":
            _check_statefulset(where, o, entries, errors)
        pod_spec = _get(o, "spec", "template", "spec", default={}, kind=dict)
        _check_metrics(where, _get(o, "spec", "template", "metadata", default={}, kind=dict),
                       _dicts(pod_spec, "containers"), errors)
        for c in _dicts(pod_spec, "containers"):
            cwhere = f"{where} container {_str(c, 'name') or '?'}"
            _check_probes(cwhere, c, errors)
            address = flags(c).get("address")
            if address is not None and _address_port(address) not in container_ports(c):
                errors.append(f"{cwhere}: --address={address} does not serve on a "
                              f"containerPort ({sorted(p for p in container_ports(c) if p)})")
            r = role(c)
            roles.add((o.get("kind"), r))
            if r == "cpu-node":
                _check_cpu_node(cwhere, pod_spec, c, errors)
                _check_node_peers(cwhere, c, errors)
            elif r == "gpu-worker":
                _check_worker(cwhere, c, entries, errors)
    if complete:
        if ("StatefulSet", "cpu-node") not in roles:
            errors.append("the manifests hold no StatefulSet of CPU nodes (--pool_bytes)")
        if not any(r == "gpu-worker" for _, r in roles):
            errors.append("the manifests hold no GPU worker (--model)")
        if not any(o.get("kind") == "PodDisruptionBudget" for _, o in entries):
            errors.append("the manifests hold no PodDisruptionBudget for the CPU nodes")
    return errors
