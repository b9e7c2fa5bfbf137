#!/usr/bin/python3
"""Validates tandem's Kubernetes manifests offline; no cluster is needed.

  /usr/bin/python3 deploy/validate.py                 # deploy/k8s + deploy/values.yaml
  /usr/bin/python3 deploy/validate.py --manifests DIR_OR_FILE --no-render-check

Checks, each problem reported with its file and field path:
  1. yamllint (config deploy/.yamllint; warnings count as problems) on the manifests and, in
     the default mode, on values.yaml;
  2. every object against the Kubernetes OpenAPI models of python3-kubernetes (k8s_schema.py):
     unknown fields, wrong types, missing required fields;
  3. the cross-object rules of k8s_semantics.py (headless Service of the StatefulSet, PDB and
     HPA targets, grpc probes, memory >= --pool_bytes, the worker's GPU and --cpu_nodes_dns);
     in the default mode also that the set is complete;
  4. unless --no-render-check, that deploy/k8s (or --rendered DIR) equals what render.py
     writes from values.yaml.
Exit status: 0 when all pass, 1 when any problem was found, 2 when a dependency is missing.

Needs Debian's python3-yaml, python3-kubernetes and yamllint (scripts/setup.sh installs them):
run it with /usr/bin/python3, not a python3 of another installation.
"""

import argparse
import difflib
import os
import sys

sys.dont_write_bytecode = True  # keep deploy/ free of __pycache__
DEPLOY_DIR = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, DEPLOY_DIR)

DEFAULT_MANIFESTS = os.path.join(DEPLOY_DIR, "k8s")
DEFAULT_VALUES = os.path.join(DEPLOY_DIR, "values.yaml")
DEFAULT_LINT_CONFIG = os.path.join(DEPLOY_DIR, ".yamllint")


def missing_dependencies():
    """Messages for each module this script cannot import."""
    needs = [("yaml", "python3-yaml"), ("kubernetes.client.models", "python3-kubernetes"),
             ("yamllint.linter", "yamllint")]
    missing = []
    for module, package in needs:
        try:
            __import__(module)
        except ImportError as e:
            missing.append(f"cannot import {module} ({e}): install Debian's {package} "
                           f"(scripts/setup.sh does) and run this with /usr/bin/python3 "
                           f"(this is {sys.executable})")
    return missing


def _rel(path):
    root = os.path.dirname(DEPLOY_DIR)
    path = os.path.abspath(path)
    return os.path.relpath(path, root) if path.startswith(root + os.sep) else path


def manifest_files(paths):
    """(*.yaml / *.yml files, errors) under each directory or file named."""
    files, errors = [], []
    for path in paths:
        if os.path.isdir(path):
            found = sorted(os.path.join(path, f) for f in os.listdir(path)
                           if f.endswith((".yaml", ".yml")))
            if not found:
                errors.append(f"{_rel(path)}: no *.yaml files")
            files += found
        elif os.path.isfile(path):
            files.append(path)
        else:
            errors.append(f"{path}: no such file or directory")
    return files, errors


def lint(files, config_path):
    """yamllint problems of the files, warnings included."""
    from yamllint import linter
    from yamllint.config import YamlLintConfig, YamlLintConfigError
    try:
        conf = YamlLintConfig(file=config_path)
    except (OSError, YamlLintConfigError) as e:
        return [f"{_rel(config_path)}: cannot read the yamllint config: {e}"]
    errors = []
    for path in files:
        with open(path, encoding="utf-8") as f:
            for p in linter.run(f, conf, path):
                errors.append(f"{_rel(path)}:{p.line}:{p.column}: yamllint {p.level}: {p.desc}")
    return errors


def load(files):
    """([(source, object)], errors): every non-empty YAML document of the files."""
    import yaml
    entries, errors = [], []
    for path in files:
        try:
            with open(path, encoding="utf-8") as f:
                docs = list(yaml.safe_load_all(f))
        except (OSError, yaml.YAMLError) as e:
            errors.append(f"{_rel(path)}: cannot read YAML: {e}")
            continue
        for i, doc in enumerate(d for d in docs if d is not None):
            source = _rel(path) if len(docs) == 1 else f"{_rel(path)}[{i}]"
            entries.append((source, doc))
    return entries, errors


def schema_errors(entries):
    import k8s_schema
    errors = []
    for source, obj in entries:
        name = "?"
        if isinstance(obj, dict):
            name = f"{obj.get('kind', '?')}/{(obj.get('metadata') or {}).get('name', '?')}"
        errors += [f"{source}: {name}: {e}" for e in k8s_schema.check_object(obj)]
    return errors


def render_check(manifest_dir, values_path):
    """Differences between manifest_dir and render.py's output from values_path."""
    import render
    if not os.path.isdir(manifest_dir):
        return [f"{_rel(manifest_dir)}: no such directory to compare with render.py's output"]
    try:
        values = render.load_values(defaults_path=values_path)
    except render.ValuesError as e:
        return [f"{_rel(values_path)}: bad values: {e}"]
    rendered = render.render(values)
    fix = "run /usr/bin/python3 deploy/render.py to re-render"
    errors = []
    present = {f for f in os.listdir(manifest_dir) if f.endswith((".yaml", ".yml"))}
    for name in sorted(present - set(rendered)):
        errors.append(f"{_rel(os.path.join(manifest_dir, name))}: not written by render.py "
                      f"from {_rel(values_path)} ({fix})")
    for name, text in rendered.items():
        path = os.path.join(manifest_dir, name)
        if name not in present:
            errors.append(f"{_rel(path)}: missing; render.py writes it ({fix})")
            continue
        with open(path, encoding="utf-8") as f:
            committed = f.read()
        if committed != text:
            diff = list(difflib.unified_diff(committed.splitlines(), text.splitlines(),
                                             "committed", "rendered", lineterm="", n=1))
            shown = "\n    ".join(diff[:20]) + ("\n    ..." if len(diff) > 20 else "")
            errors.append(f"{_rel(path)}: differs from render.py's output ({fix}):\n    {shown}")
    return errors


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--manifests", action="append", metavar="PATH",
                        help="a directory of *.yaml or a file to check (repeatable); default "
                             "deploy/k8s, which is also checked for completeness")
    parser.add_argument("--no-render-check", action="store_true",
                        help="skip comparing the rendered directory with render.py's output")
    parser.add_argument("--rendered", default=DEFAULT_MANIFESTS, metavar="DIR",
                        help="the directory the render check compares (default deploy/k8s)")
    parser.add_argument("--values", default=DEFAULT_VALUES, metavar="FILE",
                        help="values rendered for the render check (default deploy/values.yaml)")
    parser.add_argument("--yamllint-config", default=DEFAULT_LINT_CONFIG, metavar="FILE")
    args = parser.parse_args(argv)

    missing = missing_dependencies()
    if missing:
        for m in missing:
            print(f"validate.py: error: {m}", file=sys.stderr)
        return 2
    import k8s_semantics

    default_mode = not args.manifests
    files, problems = manifest_files(args.manifests or [DEFAULT_MANIFESTS])
    lint_files = files + ([args.values] if default_mode else [])
    problems += lint(lint_files, args.yamllint_config)
    entries, load_errors = load(files)
    problems += load_errors
    problems += schema_errors(entries)
    problems += k8s_semantics.check(entries, complete=default_mode)
    if not args.no_render_check:
        problems += render_check(args.rendered, args.values)

    if problems:
        for p in problems:
            print(f"validate.py: error: {p}", file=sys.stderr)
        print(f"validate.py: {len(problems)} problem(s) in {len(files)} file(s)", file=sys.stderr)
        return 1
    checks = "yamllint, schema, semantics" + ("" if args.no_render_check else ", render check")
    print(f"validate.py: OK: {len(entries)} objects in {len(files)} files ({checks})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
