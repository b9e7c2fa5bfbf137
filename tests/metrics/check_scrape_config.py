#!/usr/bin/python3
"""promtool check config on deploy/prometheus/prometheus.yml (ctest metrics.scrape_config).

Debian's Prometheus is built without Kubernetes service discovery, so each job's
kubernetes_sd_configs is replaced by a static target first: what is checked is the rest of the
file (the relabelling: its regexes, labels and actions). Exit 77 (skipped) without promtool.
"""

import os
import shutil
import subprocess
import sys
import tempfile

import yaml

sys.dont_write_bytecode = True


def main():
    if shutil.which("promtool") is None:
        print("promtool is not installed: skipped")
        return 77
    path = sys.argv[1]
    with open(path, encoding="utf-8") as f:
        config = yaml.safe_load(f)
    jobs = config.get("scrape_configs") or []
    if not jobs:
        print(f"{path}: no scrape_configs")
        return 1
    for job in jobs:
        if "kubernetes_sd_configs" not in job:
            print(f"{path}: job {job.get('job_name')} has no kubernetes_sd_configs")
            return 1
        del job["kubernetes_sd_configs"]
        job["static_configs"] = [{"targets": ["127.0.0.1:9400"]}]
    with tempfile.TemporaryDirectory() as tmp:
        checked = os.path.join(tmp, "prometheus.yml")
        with open(checked, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        proc = subprocess.run(["promtool", "check", "config", checked], capture_output=True,
                              text=True, check=False)
    print(proc.stdout + proc.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
