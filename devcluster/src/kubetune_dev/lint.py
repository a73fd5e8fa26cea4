"""`make lint`: kube-score and checkov over everything kubetune deploys; every exception has a reason.

What is linted (the targets):
  * the Helm chart, rendered with `helm template` for the value combinations users deploy:
    its defaults (backend pytorchjob), backend trainjob (with the ClusterTrainingRuntime),
    operator.watchNamespaces (a Role per namespace) with kueue.enabled, the Prometheus
    Operator's ServiceMonitor and PodMonitor, and a hardened install (cert-manager certificates,
    NetworkPolicies); the `helm test` pod is included;
  * manifests/install.yaml, what `kubectl apply` users install;
  * the trainer pods the operator creates for every example in manifests/examples through both
    backends, with the NetworkPolicy networkPolicy.enabled adds (kubetune_dev.trainer_pods: the
    linters skip the Kubeflow kinds, so each pod template is linted as the Pod a Kubeflow
    controller makes of it).

The linters: kube-score (built from the Go module proxy by devcluster/build.sh, cached per
version; it stands in for kube-linter, which the proxy does not serve here) and checkov (PyPI,
in its own virtualenv .venv-lint, `make lint-tools`). A finding fails the run unless an entry of
lint/exceptions.yaml covers it, and every entry must say why; an entry that covers nothing fails
too, so the file never keeps a stale excuse. A linter that is missing, crashes or reads no
object from a target also fails the run: a lint that did not look must not pass.

Usage:
  python -m kubetune_dev.lint                 # every target (what `make lint` and the test run)
  python -m kubetune_dev.lint --keep DIR      # also keep the rendered manifests in DIR
  python -m kubetune_dev.lint --no-exceptions FILE...   # lint these files alone, nothing excused
"""
from __future__ import annotations

import argparse
import fnmatch
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from kubetune_dev import versions

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "kubetune"
INSTALL_MANIFEST = REPO / "manifests" / "install.yaml"
EXCEPTIONS_FILE = REPO / "lint" / "exceptions.yaml"
# checkov lives in its own virtualenv (its pins conflict with the main one); CHECKOV overrides.
DEFAULT_CHECKOV = REPO / ".venv-lint" / "bin" / "checkov"
LINTERS = ("kube-score", "checkov")

# The chart's value combinations: target name -> `helm template` arguments.
CHART_VARIANTS: dict[str, list[str]] = {
    "chart-defaults": [],
    "chart-pytorchjob": ["--set", "backend=pytorchjob"],
    # Kueue with the preemption cost: the Workload patch right, in Roles as watched namespaces get them.
    "chart-watch-namespaces": ["--set", "operator.watchNamespaces={team-a,team-b}", "--set", "kueue.enabled=true",
                               "--set", "kueue.preemptionCost=true"],
    "chart-monitors": ["--set", "metrics.serviceMonitor.enabled=true", "--set", "metrics.podMonitor.enabled=true"],
    "chart-hardened": ["--set", "webhook.certificates=cert-manager", "--set", "networkPolicy.enabled=true"],
}
TRAINER_PODS = "trainer-pods"
INSTALL = "install-yaml"
# kube-score's optional checks worth having: every pod here sets a seccomp profile.
KUBE_SCORE_OPTIONAL = ["container-seccomp-profile"]


class LintError(RuntimeError):
    """A linter could not run, or did not read what it was given."""


@dataclass(frozen=True)
class Finding:
    linter: str
    check: str
    target: str   # which rendered file (chart-defaults, trainer-pods, ...)
    obj: str      # Kind/name
    detail: str

    def __str__(self) -> str:
        return f"{self.linter} {self.check} [{self.target}] {self.obj}: {self.detail}"


@dataclass
class Exception_:
    """One entry of lint/exceptions.yaml: a finding kept on purpose, and why."""

    linter: str
    check: str
    why: str
    objects: list[str] = field(default_factory=lambda: ["*"])
    targets: list[str] = field(default_factory=lambda: ["*"])
    matching: str = ""
    used: int = 0

    def covers(self, finding: Finding) -> bool:
        return (finding.linter == self.linter and finding.check == self.check
                and any(fnmatch.fnmatchcase(finding.obj, pattern) for pattern in self.objects)
                and any(fnmatch.fnmatchcase(finding.target, pattern) for pattern in self.targets)
                and self.matching in finding.detail)

    def __str__(self) -> str:
        narrowed = f" matching {self.matching!r}" if self.matching else ""
        return f"{self.linter} {self.check} on {self.objects} in {self.targets}{narrowed}"


def load_exceptions(path: Path = EXCEPTIONS_FILE) -> list[Exception_]:
    entries = yaml.safe_load(path.read_text()) or []
    allowed = {"linter", "check", "why", "objects", "targets", "matching"}
    result = []
    for entry in entries:
        unknown = set(entry) - allowed
        if unknown or entry.get("linter") not in LINTERS or not entry.get("check"):
            raise LintError(f"{path}: bad entry {entry} (keys {sorted(allowed)}, linter one of {LINTERS})")
        if not str(entry.get("why") or "").strip():
            raise LintError(f"{path}: the exception for {entry['linter']} {entry['check']} gives no reason (why:)")
        result.append(Exception_(**entry))
    return result


# ---- the targets -------------------------------------------------------------------------------

def tool(name: str) -> str:
    """The path of a linter or helm, or a LintError naming the command that installs it."""
    if name == "checkov":
        # Absolute: checkov runs in the directory of the rendered manifests.
        path = Path(os.environ.get("CHECKOV") or DEFAULT_CHECKOV).resolve()
        if not os.access(path, os.X_OK):
            raise LintError(f"checkov is not installed at {path}: run `make lint-tools` (a virtualenv from "
                            "requirements-lint.txt)")
        return str(path)
    try:
        return str(versions.binary(name))
    except versions.MissingBinary as err:
        raise LintError(f"{name} is missing: run `make lint-tools` ({err})") from None


def render_targets(workdir: Path) -> dict[str, Path]:
    """Write every target into WORKDIR as NAME.yaml; return name -> path."""
    from kubetune_dev.trainer_pods import every_examples_trainer_pods  # imports the operator: only when rendering

    helm = tool("helm")
    kube_version = versions.versions()["KUBERNETES_VERSION"]
    files: dict[str, Path] = {}
    for name, values in CHART_VARIANTS.items():
        result = subprocess.run([helm, "template", "kubetune", str(CHART), "--namespace", "kubetune-system",
                                 "--kube-version", kube_version, *values], capture_output=True, text=True)
        if result.returncode != 0:
            raise LintError(f"helm template ({name}) failed: {result.stderr}")
        files[name] = workdir / f"{name}.yaml"
        files[name].write_text(result.stdout)
    files[INSTALL] = workdir / f"{INSTALL}.yaml"
    files[INSTALL].write_text(INSTALL_MANIFEST.read_text())
    files[TRAINER_PODS] = workdir / f"{TRAINER_PODS}.yaml"
    files[TRAINER_PODS].write_text(yaml.safe_dump_all(every_examples_trainer_pods(), sort_keys=False))
    return files


# ---- the linters --------------------------------------------------------------------------------

def kube_score(target: str, path: Path) -> tuple[list[Finding], int]:
    """kube-score on one file (each file alone: a Service must find its pods in the same render)."""
    kubernetes = ".".join(versions.versions()["KUBERNETES_VERSION"].split(".")[:2])  # v1.34
    command = [tool("kube-score"), "score", "--kubernetes-version", kubernetes, "--output-format", "json"]
    for test in KUBE_SCORE_OPTIONAL:
        command += ["--enable-optional-test", test]
    result = subprocess.run([*command, str(path)], capture_output=True, text=True)
    # Exit 1 means findings; anything else, or no JSON, means it did not run.
    if result.returncode not in (0, 1):
        raise LintError(f"kube-score failed on {target} (exit {result.returncode}): {result.stderr}")
    try:
        objects = json.loads(result.stdout) or []
    except json.JSONDecodeError:
        raise LintError(f"kube-score printed no JSON for {target}: {result.stdout[:500]} {result.stderr}") from None
    findings = []
    for scored in objects:
        obj = f"{scored['type_meta']['kind']}/{scored['object_meta']['name']}"
        for check in scored["checks"]:
            # Grades: 10 all OK, 7 almost OK, 5 warning, 1 critical; warnings count as findings too.
            if check["skipped"] or check["grade"] >= 10:
                continue
            for comment in check["comments"] or [{"path": "", "summary": check["check"]["name"]}]:
                where = f"({comment['path']}) " if comment.get("path") else ""
                findings.append(Finding("kube-score", check["check"]["id"], target, obj, where + comment["summary"]))
    return findings, len(objects)


def _checkov_object(resource: str) -> str:
    """checkov's resource id `Kind.namespace.name[...]` as Kind/name (cluster-scoped: namespace `default`)."""
    parts = resource.split(".")
    return f"{parts[0]}/{parts[2] if len(parts) > 2 else parts[-1]}"


def checkov(files: dict[str, Path]) -> tuple[list[Finding], dict[str, int]]:
    """checkov on every file in one run (it starts slowly); findings attributed to their target."""
    workdir = {path.parent for path in files.values()}
    if len(workdir) != 1:
        raise LintError("checkov's targets must share one directory")
    by_file = {f"/{path.name}": name for name, path in files.items()}
    command = [tool("checkov"), "--framework", "kubernetes", "--output", "json", "--skip-download", "--compact"]
    for path in files.values():
        command += ["--file", path.name]
    result = subprocess.run(command, capture_output=True, text=True, cwd=workdir.pop(),
                            env={**os.environ, "BC_SKIP_MAPPING": "TRUE"})
    if result.returncode not in (0, 1):
        raise LintError(f"checkov failed (exit {result.returncode}): {result.stderr[-2000:]}")
    try:
        reports = json.loads(result.stdout)
    except json.JSONDecodeError:
        raise LintError(f"checkov printed no JSON: {result.stdout[:500]} {result.stderr[-2000:]}") from None
    reports = reports if isinstance(reports, list) else [reports]
    findings, resources = [], {name: 0 for name in files}
    for report in reports:
        if report.get("summary", {}).get("parsing_errors"):
            raise LintError(f"checkov could not parse a target: {report['summary']}")
        results = report.get("results", {})
        for outcome in ("passed_checks", "failed_checks"):
            seen = set()
            for check in results.get(outcome, []):
                target = by_file.get(check["file_path"])
                if target is None:
                    raise LintError(f"checkov reported a file it was not given: {check['file_path']}")
                if (target, check["resource"]) not in seen:
                    seen.add((target, check["resource"]))
                    resources[target] += 1
                if outcome == "failed_checks":
                    findings.append(Finding("checkov", check["check_id"], target, _checkov_object(check["resource"]),
                                            check["check_name"]))
    return findings, resources


def lint_files(files: dict[str, Path]) -> list[Finding]:
    """Every finding of both linters; a LintError when a linter read nothing from a target."""
    findings = []
    for target, path in files.items():
        found, objects = kube_score(target, path)
        if objects == 0:
            raise LintError(f"kube-score read no object from {target} ({path})")
        findings += found
    found, resources = checkov(files)
    empty = [target for target, count in resources.items() if count == 0]
    if empty:
        raise LintError(f"checkov checked no resource in {empty}")
    return findings + found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--keep", type=Path, help="keep the rendered manifests in this directory")
    parser.add_argument("--no-exceptions", action="store_true", help="excuse nothing (lint/exceptions.yaml unused)")
    parser.add_argument("files", nargs="*", type=Path, help="lint these manifests instead of kubetune's")
    args = parser.parse_args(argv)
    try:
        exceptions = [] if args.no_exceptions else load_exceptions()
        with tempfile.TemporaryDirectory(prefix="kubetune-lint-") as tmp:
            workdir = args.keep or Path(tmp)
            workdir.mkdir(parents=True, exist_ok=True)
            if args.files:
                files = {}
                for path in args.files:
                    files[path.stem] = workdir / path.name
                    files[path.stem].write_text(path.read_text())
            else:
                files = render_targets(workdir)
            findings = lint_files(files)
    except LintError as err:
        print(f"lint: {err}", file=sys.stderr)
        return 2
    failures = []
    for finding in findings:
        covering = next((e for e in exceptions if e.covers(finding)), None)
        if covering:
            covering.used += 1
        else:
            failures.append(finding)
    # An exception only applies to kubetune's own targets; with FILES, unused ones are expected.
    stale = [e for e in exceptions if not e.used] if not args.files else []
    for finding in failures:
        print(f"FAIL {finding}")
    for entry in stale:
        print(f"STALE exception (covers no finding; remove it from {EXCEPTIONS_FILE.name}): {entry}")
    excused = len(findings) - len(failures)
    print(f"lint: {len(files)} targets ({', '.join(files)}), {len(findings)} findings: "
          f"{excused} excused by lint/exceptions.yaml, {len(failures)} failing, {len(stale)} stale exceptions")
    return 1 if failures or stale else 0


if __name__ == "__main__":
    sys.exit(main())
