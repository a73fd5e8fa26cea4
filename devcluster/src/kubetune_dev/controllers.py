"""The Go controllers beside the training operator: JobSet, Kubeflow Trainer v2 and Kueue.

Each runs as a host process with its own client certificate, as the training operator does,
because all three serve admission webhooks (Kueue also a CRD conversion webhook) that the API
server must call, and a Service cannot route to a loopback address (see webhooks.py). So each:

  * gets a Configuration file (their own config API) that binds every server to 127.0.0.1,
    turns leader election off (one replica) and turns the built-in certificate rotation off:
    that rotation signs for `<service>.<namespace>.svc` and patches the caBundle for a Service,
    which the API server here cannot reach; the certificate is certs.py's, signed for 127.0.0.1;
  * serves its webhooks on a port of its own; webhooks.py registers them by URL once it is ready;
  * has its metrics server switched off: nothing scrapes them here, and each would be one more
    TLS listener with its own certificate rules.

Where a controller reads a certificate from a fixed path (Trainer's webhook directory, Kueue's
metrics directory), it runs in the sandbox with the certificate directory bind-mounted there,
as the training operator does for its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import yaml

from kubetune_dev import versions
from kubetune_dev.webhooks import conversion_crd_names, loopback_webhook_configurations, with_conversion_webhook

# controller-runtime's default webhook certificate directory ({TempDir}/k8s-webhook-server/...).
DEFAULT_CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"
# Kueue reads its metrics certificate from here whenever its own cert management is off, even
# with the metrics server disabled (cmd/kueue/main.go), and exits when the files are missing.
KUEUE_METRICS_CERT_DIR = "/etc/kueue/metrics/certs"
KUEUE_NAMESPACE = "kueue-system"
# The integrations Kueue runs here, and the (group, resource) pairs whose webhooks it needs:
# its own API and the three job kinds kubetune's backends create.
KUEUE_FRAMEWORKS = ["kubeflow.org/pytorchjob", "jobset.x-k8s.io/jobset", "trainer.kubeflow.org/trainjob"]
KUEUE_SERVED = {("kueue.x-k8s.io", "*"), ("kubeflow.org", "pytorchjobs"), ("jobset.x-k8s.io", "jobsets"),
                ("trainer.kubeflow.org", "trainjobs")}


def _yaml(path: Path) -> dict:
    # The C loader: Kueue's CRDs are megabytes of YAML, read at every `up`.
    return yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))


@dataclass(frozen=True)
class Controller:
    """One Go controller: what it is built as, how it is configured, what it registers."""

    name: str           # component, pid file, log file, kubeconfig client and port-name prefix
    binary: str         # key of versions._COMPONENTS
    configuration: Callable[[int, int, str], dict]  # (webhook port, health port, cert dir) -> config
    crd_files: Callable[[], list[Path]]
    # Fixed paths in the binary where it reads tls.crt/tls.key: bind-mounted in the sandbox.
    cert_mounts: tuple[str, ...] = ()
    served: set[tuple[str, str]] | None = None     # webhooks kept (None: all of them)
    object_selectors: dict[str, dict] = field(default_factory=dict)
    conversion_crds: Callable[[], set[str]] = set   # CRDs converted by its webhook
    # What its chart installs beside the controller for clients to read (applied with the webhooks).
    public_objects: Callable[[], list[dict]] = list

    @property
    def config_dir(self) -> Path:
        return versions.config_dir(self.binary)

    def crds(self, webhook_port: int, ca: str) -> list[dict]:
        converted = self.conversion_crds()
        crds = [_yaml(path) for path in self.crd_files()]
        return [with_conversion_webhook(crd, webhook_port, ca) if crd["metadata"]["name"] in converted else crd
                for crd in crds]

    def webhook_configurations(self, webhook_port: int, ca: str) -> list[dict]:
        return loopback_webhook_configurations((self.config_dir / "manifests.yaml").read_text(), self.name,
                                               webhook_port, ca, self.served, self.object_selectors)


def _jobset_configuration(webhook_port: int, health_port: int, cert_dir: str) -> dict:
    return {
        "apiVersion": "config.jobset.x-k8s.io/v1alpha1", "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": cert_dir},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0", "certDir": cert_dir},
    }


def _trainer_configuration(webhook_port: int, health_port: int, cert_dir: str) -> dict:
    # No certDir option: the webhook server reads DEFAULT_CERT_DIR (mounted in the sandbox).
    # The TrainJobStatus feature (alpha, off by default) would add a server on all interfaces.
    return {
        "apiVersion": "config.trainer.kubeflow.org/v1alpha1", "kind": "Configuration",
        "leaderElection": {"leaderElect": False},
        "certManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1"},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}",
                   "readinessEndpointName": "readyz", "livenessEndpointName": "healthz"},
        "metrics": {"bindAddress": "0"},
    }


TRAINER_NAMESPACE = "kubeflow-system"


def _trainer_public_objects() -> list[dict]:
    """The ConfigMap Trainer's chart publishes its version in, and the right of every authenticated
    user to read it: the Kubeflow SDK's TrainerClient reads it when it starts (and warns without it)."""
    name, namespace = "kubeflow-trainer-public", TRAINER_NAMESPACE
    return [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": name, "namespace": namespace},
         "data": {"kubeflow_trainer_version": versions.versions()["TRAINER_VERSION"].removeprefix("v")}},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name, "namespace": namespace},
         "rules": [{"apiGroups": [""], "resources": ["configmaps"], "resourceNames": [name], "verbs": ["get"]}]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": {"name": name, "namespace": namespace},
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "Group", "apiGroup": "rbac.authorization.k8s.io", "name": "system:authenticated"}]},
    ]


def _kueue_configuration(webhook_port: int, health_port: int, cert_dir: str) -> dict:
    return {
        "apiVersion": "config.kueue.x-k8s.io/v1beta2", "kind": "Configuration",
        "namespace": KUEUE_NAMESPACE,
        "leaderElection": {"leaderElect": False},
        "internalCertManagement": {"enable": False},
        "webhook": {"port": webhook_port, "host": "127.0.0.1", "certDir": cert_dir},
        "health": {"healthProbeBindAddress": f"127.0.0.1:{health_port}"},
        "metrics": {"bindAddress": "0"},
        "integrations": {"frameworks": KUEUE_FRAMEWORKS},
        # The on-demand visibility API is an aggregated API server on a fixed port of every
        # interface; pending workloads are readable from the Workload objects instead.
        # PriorityBoost (alpha, KEP-7990): Kueue adds a Workload's kueue.x-k8s.io/priority-boost to its
        # priority, which the operator's kueue.preemptionCost sets from a job's unsaved work.
        "featureGates": {"VisibilityOnDemand": False, "PriorityBoost": True},
    }


def _kueue_conversion_crds() -> set[str]:
    patches_dir = versions.config_dir("kueue") / "crd-patches"
    patches = {p.name: p.read_text() for p in patches_dir.glob("webhook_in_*.yaml")}
    return conversion_crd_names((patches_dir / "kustomization.yaml").read_text(), patches)


# Upstream adds these with a kustomize patch: JobSet's pod webhooks only see JobSet's own pods.
_JOBSET_PODS_ONLY = {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}

CONTROLLERS = [
    Controller("jobset", "jobset", _jobset_configuration,
               lambda: sorted(versions.config_dir("jobset").glob("jobset.x-k8s.io_*.yaml")),
               object_selectors={"mpod.kb.io": _JOBSET_PODS_ONLY, "vpod.kb.io": _JOBSET_PODS_ONLY}),
    Controller("trainer", "trainer-controller-manager", _trainer_configuration,
               lambda: sorted(versions.config_dir("trainer-controller-manager").glob("trainer.kubeflow.org_*.yaml")),
               cert_mounts=(DEFAULT_CERT_DIR,), public_objects=_trainer_public_objects),
    Controller("kueue", "kueue", _kueue_configuration,
               lambda: sorted((versions.config_dir("kueue") / "crds").glob("kueue.x-k8s.io_*.yaml")),
               cert_mounts=(KUEUE_METRICS_CERT_DIR,), served=KUEUE_SERVED,
               conversion_crds=_kueue_conversion_crds),
]
