#!/usr/bin/python3
"""Test cases for deploy/render.py and deploy/validate.py (ctest label "deploy").

  /usr/bin/python3 tests/deploy/run_cases.py bad FILE   # validate.py rejects FILE as it says
  /usr/bin/python3 tests/deploy/run_cases.py sizes|overrides|bad_values|drift

A bad manifest names what validate.py must say about it in its header comments:
  # expect: <text that must appear in one error line>     (one or more)
  # expect-count: <number of error lines>                 (so nothing else is wrong with it)
Every case prints its checks and "N passed, N failed"; the exit status is 1 if any failed.
"""

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile

sys.dont_write_bytecode = True
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEPLOY = os.path.join(ROOT, "deploy")
sys.path.insert(0, DEPLOY)


class Results:
    def __init__(self):
        self.passed, self.failed = 0, 0

    def check(self, ok, what, detail=""):
        if ok:
            self.passed += 1
            print(f"PASS {what}")
        else:
            self.failed += 1
            print(f"FAIL {what}" + (f"\n{detail}" if detail else ""))

    def finish(self):
        print(f"{self.passed} passed, {self.failed} failed")
        return 0 if self.failed == 0 and self.passed > 0 else 1


def run(script, *args):
    proc = subprocess.run([sys.executable, os.path.join(DEPLOY, script), *args],
                          capture_output=True, text=True, timeout=120, check=False)
    return proc.returncode, proc.stdout, proc.stderr


def error_lines(stderr):
    return [line for line in stderr.splitlines() if line.startswith("validate.py: error:")]


def case_bad(r, path):
    expects, count = [], None
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.startswith("# expect:"):
                expects.append(line[len("# expect:"):].strip())
            elif line.startswith("# expect-count:"):
                count = int(line.split(":", 1)[1])
    r.check(bool(expects) and count is not None, f"{os.path.basename(path)} names its expected "
            f"errors (# expect: and # expect-count:)")
    rc, _, err = run("validate.py", "--manifests", path, "--no-render-check")
    errors = error_lines(err)
    r.check(rc == 1, f"validate.py exits 1 on it (got {rc})", err)
    r.check("Traceback" not in err, "validate.py does not crash", err)
    for text in expects:
        r.check(any(text in e for e in errors), f"an error says: {text}", "\n".join(errors))
    if count is not None:
        r.check(len(errors) == count, f"exactly {count} error(s) (got {len(errors)})",
                "\n".join(errors))


def case_sizes(r):
    import sizes
    gib = 1 << 30
    for text, want in [("1073741824", gib), ("8GiB", 8 * gib), ("64gib", 64 * gib),
                       ("512M", 512 << 20), ("1.5G", 3 * gib // 2), ("2T", 2 << 40),
                       ("100B", 100), (" 4K ", 4096)]:
        got = sizes.parse_byte_size(text)
        r.check(got == want, f"parse_byte_size({text!r}) == {want}", f"got {got}")
    for text in ["", "GiB", "-1G", "lots", "1e30", "nan"]:
        try:
            sizes.parse_byte_size(text)
            r.check(False, f"parse_byte_size({text!r}) is rejected")
        except ValueError:
            r.check(True, f"parse_byte_size({text!r}) is rejected")
    for value, want in [("17Gi", 17 * gib), ("10G", 10**10), ("1e3", 1000), (8, 8),
                        ("1536Mi", 3 * gib // 2), ("500m", 0.5)]:
        got = sizes.parse_quantity(value)
        r.check(got == want, f"parse_quantity({value!r}) == {want}", f"got {got}")
    for value, want in [(17 * gib, "17Gi"), (3 * gib // 2, "1536Mi"), (1000, "1000"),
                        (65 * gib, "65Gi")]:
        got = sizes.format_memory(value)
        r.check(got == want, f"format_memory({value}) == {want}", f"got {got}")


def _load_dir(path):
    import yaml
    out = {}
    for name in sorted(os.listdir(path)):
        with open(os.path.join(path, name), encoding="utf-8") as f:
            out[name] = yaml.safe_load(f)
    return out


def case_overrides(r):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "k8s")
        rc, _, err = run("render.py", "--out", out, "--set", "release=prod",
                         "--set", "namespace.name=llm", "--set", "cpuNodes.poolBytes=64GiB",
                         "--set", "cpuNodes.threads=16", "--set", "cpuNodes.hpa.enabled=false",
                         "--set", "cpuNodes.replicas=4", "--set", "gpuWorker.beta=0.5",
                         "--set", "gpuWorker.extraArgs=[--max_context=262144]")
        r.check(rc == 0, "render.py accepts the overrides", err)
        if rc != 0:
            return
        objs = _load_dir(out)
        r.check("cpu-node-hpa.yaml" not in objs, "no HPA when cpuNodes.hpa.enabled=false")
        sts = objs["cpu-node-statefulset.yaml"]
        c = sts["spec"]["template"]["spec"]["containers"][0]
        r.check(sts["metadata"]["name"] == "prod-cpu-node", "names carry the release")
        r.check(sts["spec"]["replicas"] == 4, "StatefulSet has 4 replicas")
        r.check(c["resources"]["requests"] == {"cpu": "16", "memory": "65Gi"},
                "requests are threads and pool + 1GiB overhead", str(c["resources"]))
        r.check(c["resources"]["limits"] == c["resources"]["requests"], "limits equal requests")
        r.check("--pool_bytes=64GiB" in c["args"] and "--threads=16" in c["args"],
                "node flags follow the values", str(c["args"]))
        w = objs["gpu-worker-deployment.yaml"]["spec"]["template"]["spec"]["containers"][0]
        r.check("--cpu_nodes_dns=prod-cpu-node.llm.svc.cluster.local:50061" in w["args"],
                "worker resolves the headless Service in the new namespace", str(w["args"]))
        r.check("--beta=0.5" in w["args"] and w["args"][-1] == "--max_context=262144",
                "worker flags follow the values", str(w["args"]))
        rc, out_text, err = run("validate.py", "--manifests", out, "--no-render-check")
        r.check(rc == 0, "validate.py passes the rendered overrides", out_text + err)

        rc, _, err = run("render.py", "--out", out)
        objs = _load_dir(out)
        r.check(rc == 0 and "cpu-node-hpa.yaml" in objs
                and "replicas" not in objs["cpu-node-statefulset.yaml"]["spec"],
                "with the HPA on, the StatefulSet leaves replicas to it; re-rendering into the "
                "same directory replaces the old files", err)


def case_bad_values(r):
    with tempfile.TemporaryDirectory() as tmp:
        for sets, text in [
            (["cpuNodes.poolBytes=lots"], "'lots' is not a byte size"),
            (["cpuNodes.poolSize=8GiB"], "has no key 'poolSize' under cpuNodes"),
            (["cpuNodes.threads=0"], "cpuNodes.threads: 0 is out of range"),
            (["cpuNodes.threads=eight"], "cpuNodes.threads: expected a number"),
            (["cpuNodes.hpa.minReplicas=9"], "minReplicas is above maxReplicas"),
            (["gpuWorker.transport=shm"], "only grpc applies"),
            (["gpuWorker.model.dir=../etc"], "must be a relative path under /models"),
            (["release=Tandem_1"], "is not a DNS label"),
        ]:
            args = ["--out", os.path.join(tmp, "k8s")]
            for s in sets:
                args += ["--set", s]
            rc, _, err = run("render.py", *args)
            r.check(rc == 2 and text in err, f"render.py --set {' '.join(sets)} fails: {text}",
                    f"rc={rc}\n{err}")
        r.check(not os.path.exists(os.path.join(tmp, "k8s")), "bad values write nothing")


def case_drift(r):
    with tempfile.TemporaryDirectory() as tmp:
        k8s = os.path.join(tmp, "k8s")
        shutil.copytree(os.path.join(DEPLOY, "k8s"), k8s)
        rc, _, err = run("validate.py", "--manifests", k8s, "--rendered", k8s)
        r.check(rc == 0, "a copy of deploy/k8s passes the render check", err)
        path = os.path.join(k8s, "cpu-node-statefulset.yaml")
        with open(path, encoding="utf-8") as f:
            text = f.read()
        with open(path, "w", encoding="utf-8") as f:
            f.write(text.replace("--threads=8", "--threads=9"))
        os.remove(os.path.join(k8s, "cpu-node-pdb.yaml"))
        shutil.copy(os.path.join(k8s, "gpu-worker-service.yaml"), os.path.join(k8s, "extra.yaml"))
        rc, _, err = run("validate.py", "--manifests", k8s, "--rendered", k8s,
                         "--no-render-check")
        r.check(rc == 1 and "is also defined in" in err, "a duplicated object is an error", err)
        rc, _, err = run("validate.py", "--manifests", path, "--rendered", k8s)
        errors = "\n".join(error_lines(err))
        r.check(rc == 1, "an edited rendering fails the render check", err)
        for text in ["cpu-node-statefulset.yaml: differs from render.py's output",
                     "+            - --threads=8",
                     "cpu-node-pdb.yaml: missing; render.py writes it",
                     "extra.yaml: not written by render.py"]:
            r.check(text in err, f"the render check says: {text}", errors)


def main(argv):
    if not argv or argv[0] not in ("bad", "sizes", "overrides", "bad_values", "drift"):
        print(__doc__, file=sys.stderr)
        return 2
    if importlib.util.find_spec("yaml") is None:
        print("run_cases.py: needs Debian's python3-yaml; run it with /usr/bin/python3",
              file=sys.stderr)
        return 2
    r = Results()
    if argv[0] == "bad":
        if len(argv) != 2:
            print("usage: run_cases.py bad FILE", file=sys.stderr)
            return 2
        case_bad(r, argv[1])
    else:
        globals()[f"case_{argv[0]}"](r)
    return r.finish()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
