"""The local control plane: which processes, in which order, with which flags, under one directory.

    etcd → kube-apiserver → CRDs → kube-controller-manager → training operator
         → JobSet → Kubeflow Trainer → Kueue (each with its webhooks, see controllers.py)
         → S3 server (versitygw) → Prometheus → process kubelet

Everything listens on 127.0.0.1 on ports chosen once per state directory (ports.json), so
several state directories (a developer's and the e2e tests') can run side by side. `up` starts
what is not running and waits until each part is ready, so it is idempotent; `down` stops every
recorded process, the kubelet's pods included.
"""
from __future__ import annotations

import base64
import json
import os
import secrets
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import yaml

from kubetune_api.ports import free_listen_port
from kubetune_dev import certs, processes, versions
from kubetune_dev.controllers import CONTROLLERS, KUEUE_NAMESPACE, Controller
from kubetune_dev.webhooks import ca_bundle

REPO_CRDS = Path(__file__).resolve().parents[3] / "manifests" / "crd"
PORT_NAMES = ["etcd", "etcd_peer", "apiserver", "operator_metrics", "operator_health", "operator_webhook",
              "s3", "prometheus", "kubelet"] + [f"{c.name}_{kind}" for c in CONTROLLERS for kind in ("webhook", "health")]
REGION = "us-east-1"


def default_home() -> Path:
    return Path(os.environ.get("KUBETUNE_DEV_HOME", Path.home() / ".kubetune" / "dev"))


class NotReady(RuntimeError):
    pass


@dataclass
class Component:
    name: str
    argv: Callable[[], list[str]]
    ready: Callable[[], bool]
    env: Callable[[], dict[str, str]] = dict
    timeout: float = 60.0


class Cluster:
    def __init__(self, home: Path | None = None, log: Callable[[str], None] = print):
        self.home = (home or default_home()).resolve()
        self.log = log
        self.pki = self.home / "pki"
        self.run_dir = self.home / "run"      # pid files
        self.logs = self.home / "logs"
        self.kubelet_state = self.home / "kubelet"
        self.components = self._components()

    # ---- layout -------------------------------------------------------------------------------
    @property
    def ports(self) -> dict[str, int]:
        path = self.home / "ports.json"
        ports = json.loads(path.read_text()) if path.exists() else {}
        if missing := [name for name in PORT_NAMES if name not in ports]:
            # A new state directory, or one made before a component was added: chosen once, kept.
            self.home.mkdir(parents=True, exist_ok=True)
            for name in missing:  # bound later (Prometheus a minute later): kubetune_api.ports says why
                ports[name] = free_listen_port(taken=set(ports.values()))
            path.write_text(json.dumps(ports, indent=1))
        return ports

    @property
    def s3_credentials(self) -> dict[str, str]:
        path = self.home / "s3-credentials.json"
        if not path.exists():
            self.home.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps({"access_key": "kubetune" + secrets.token_hex(4),
                                        "secret_key": secrets.token_urlsafe(24)}))
            path.chmod(0o600)
        return json.loads(path.read_text())

    def kubeconfig(self, client: str = "admin") -> Path:
        return self.home / "kubeconfigs" / f"{client}.yaml"

    @property
    def server(self) -> str:
        return f"https://127.0.0.1:{self.ports['apiserver']}"

    def env(self) -> dict[str, str]:
        """What a shell needs to use this control plane (printed by `kubetune dev env`)."""
        creds, ports = self.s3_credentials, self.ports
        tool_dirs = [str(versions.binary("kubectl").parent), str(versions.binary("helm").parent)]
        return {
            "KUBECONFIG": str(self.kubeconfig()),
            "PATH": ":".join(tool_dirs + [os.environ.get("PATH", "")]),
            "AWS_ENDPOINT_URL": f"http://127.0.0.1:{ports['s3']}",
            "AWS_ACCESS_KEY_ID": creds["access_key"],
            "AWS_SECRET_ACCESS_KEY": creds["secret_key"],
            "AWS_DEFAULT_REGION": REGION,
            "PROMETHEUS_URL": f"http://127.0.0.1:{ports['prometheus']}",
        }

    def mlflow_server(self, bucket: str = "mlflow"):
        """An MLflow tracking server beside this control plane (spec.tracking.mlflow): SQLite in its
        home, artifacts served through it into s3://BUCKET/mlflow on its S3 server, on loopback where
        the pods reach it. Started by the caller (`with cluster.mlflow_server() as server:`), which
        also stops it; only the server gets the S3 credentials."""
        import boto3

        from kubetune_dev.mlflow_server import MlflowServer

        env = self.env()
        s3 = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name=REGION,
                          aws_access_key_id=env["AWS_ACCESS_KEY_ID"], aws_secret_access_key=env["AWS_SECRET_ACCESS_KEY"])
        if bucket not in {b["Name"] for b in s3.list_buckets().get("Buckets", [])}:
            s3.create_bucket(Bucket=bucket)
        return MlflowServer(self.home / "mlflow", f"s3://{bucket}/mlflow", env["AWS_ENDPOINT_URL"],
                            env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"], REGION)

    # ---- probes -------------------------------------------------------------------------------
    def _get(self, url: str, tls: bool = False) -> tuple[int, bytes]:
        context = None
        if tls:
            context = ssl.create_default_context(cafile=str(self.pki / "ca.crt"))
            context.load_cert_chain(self.pki / "admin.crt", self.pki / "admin.key")
        # No proxy, whatever the environment says: every address here is loopback.
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=context))
        try:
            with opener.open(url, timeout=3) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()
        except (urllib.error.URLError, OSError):
            return 0, b""

    def api_get(self, path: str) -> tuple[int, bytes]:
        return self._get(self.server + path, tls=True)

    def kubectl_argv(self) -> list[str]:
        """kubectl as the admin of this control plane (for a caller that streams: logs -f, exec, port-forward)."""
        return [str(versions.binary("kubectl")), "--kubeconfig", str(self.kubeconfig())]

    def kubectl(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run([*self.kubectl_argv(), *args], capture_output=True, text=True, input=input)
        if check and result.returncode != 0:
            raise NotReady(f"kubectl {' '.join(args)}: {result.stderr.strip()}")
        return result

    def _exists(self, path: str) -> bool:
        return self.api_get(path)[0] == 200

    # ---- components ---------------------------------------------------------------------------
    def _components(self) -> list[Component]:
        p = lambda name: self.ports[name]  # noqa: E731  (ports are chosen lazily, on first use)
        pki = self.pki
        return [
            Component("etcd", lambda: [
                str(versions.binary("etcd")), "--name=default", f"--data-dir={self.home / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{p('etcd')}",
                f"--advertise-client-urls=http://127.0.0.1:{p('etcd')}",
                f"--listen-peer-urls=http://127.0.0.1:{p('etcd_peer')}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p('etcd_peer')}",
                f"--initial-cluster=default=http://127.0.0.1:{p('etcd_peer')}",
                # A throwaway development store: skipping fsync makes every write much faster.
                "--unsafe-no-fsync", "--log-level=warn"],
                lambda: self._get(f"http://127.0.0.1:{p('etcd')}/health")[0] == 200),
            Component("kube-apiserver", lambda: [
                str(versions.binary("kube-apiserver")), f"--etcd-servers=http://127.0.0.1:{p('etcd')}",
                "--bind-address=127.0.0.1", "--advertise-address=127.0.0.1", f"--secure-port={p('apiserver')}",
                f"--cert-dir={self.home / 'apiserver'}",
                f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
                f"--client-ca-file={pki / 'ca.crt'}",
                "--authorization-mode=RBAC",
                # PodSecurity is on by default; listed so that no one drops it by accident.
                "--enable-admission-plugins=NamespaceLifecycle,ServiceAccount,PodSecurity",
                "--service-account-issuer=https://kubernetes.default.svc.cluster.local",
                f"--service-account-key-file={pki / 'sa.pub'}",
                f"--service-account-signing-key-file={pki / 'sa.key'}",
                # Cluster IPs on loopback, so the kubelet's proxy can listen on them and the API server
                # reaches Services (a webhook's clientConfig.service) as in a cluster (serviceproxy.py).
                "--service-cluster-ip-range=127.2.0.0/16", "--allow-privileged=true", "--profiling=false",
                # Endpoints may not hold loopback addresses; pods reach the API server directly.
                "--endpoint-reconciler-type=none",
                # The kubelet's API (`kubectl logs`): at the node's InternalIP, since no resolver knows its
                # hostname; its certificate checked against our CA, ours presented to it.
                "--kubelet-preferred-address-types=InternalIP",
                f"--kubelet-certificate-authority={pki / 'ca.crt'}",
                f"--kubelet-client-certificate={pki / (certs.KUBELET_CLIENT + '.crt')}",
                f"--kubelet-client-key={pki / (certs.KUBELET_CLIENT + '.key')}",
                # `kubectl exec` reaches the kubelet as the WebSocket kubectl opened, not translated into
                # SPDY, which is all this kubelet would not speak (kubelet_exec.py).
                "--feature-gates=TranslateStreamCloseWebsocketRequests=false"],
                lambda: self.api_get("/readyz")[0] == 200, timeout=90),
            Component("kube-controller-manager", lambda: [
                str(versions.binary("kube-controller-manager")),
                f"--kubeconfig={self.kubeconfig('controller-manager')}",
                # No serving port: nothing scrapes it and it must not bind beyond loopback.
                "--secure-port=0", "--leader-elect=false",
                "--controllers=garbage-collector-controller,namespace-controller,serviceaccount-controller,"
                "serviceaccount-token-controller,root-ca-certificate-publisher-controller,"
                "endpoints-controller,endpointslice-controller,replicaset-controller,deployment-controller,"
                "job-controller,clusterrole-aggregation-controller,"
                # Binds PersistentVolumeClaims to PersistentVolumes (the kubelet mounts their host paths),
                # and releases the protection finalizers the API server puts on both once no pod uses them.
                "persistentvolume-binder-controller,persistentvolumeclaim-protection-controller,"
                "persistentvolume-protection-controller",
                f"--root-ca-file={pki / 'ca.crt'}", f"--service-account-private-key-file={pki / 'sa.key'}"],
                # Pods need the default ServiceAccount; the controller manager creates it.
                lambda: self._exists("/api/v1/namespaces/default/serviceaccounts/default")),
            Component("training-operator", self._training_operator_argv, self._training_operator_ready,
                      env=lambda: {"KUBECONFIG": str(self.kubeconfig("training-operator"))}),
            *[Component(c.name, lambda c=c: self._controller_argv(c), lambda c=c: self._controller_ready(c),
                        env=lambda c=c: {"KUBECONFIG": str(self.kubeconfig(c.name))}) for c in CONTROLLERS],
            Component("s3", lambda: [
                str(versions.binary("versitygw")), "--access", self.s3_credentials["access_key"],
                "--secret", self.s3_credentials["secret_key"], "--region", REGION,
                "--port", f"127.0.0.1:{p('s3')}", "posix", str(self.home / "s3")],
                lambda: self._get(f"http://127.0.0.1:{p('s3')}/")[0] != 0),
            Component("prometheus", lambda: [
                str(versions.binary("prometheus")), f"--config.file={self._prometheus_config()}",
                f"--storage.tsdb.path={self.home / 'prometheus' / 'data'}",
                f"--web.listen-address=127.0.0.1:{p('prometheus')}"],
                lambda: self._get(f"http://127.0.0.1:{p('prometheus')}/-/ready")[0] == 200),
            Component("kubelet", lambda: [
                sys.executable, "-m", "kubetune_dev.kubelet", f"--kubeconfig={self.kubeconfig('kubelet')}",
                f"--state={self.kubelet_state}", f"--api-port={p('apiserver')}",
                f"--prometheus-targets={self.prometheus_targets}", f"--port={p('kubelet')}", f"--pki={pki}"],
                self._kubelet_ready),
        ]

    def _kubelet_ready(self) -> bool:
        """The running kubelet registered its Node and synced once (it writes its pid then)."""
        proc = processes.running(self._pid_file("kubelet"))
        ready_file = self.kubelet_state / "ready"
        if proc is None or not ready_file.exists() or ready_file.read_text() != str(proc.pid):
            return False
        status, body = self.api_get("/api/v1/nodes/kubetune-dev")
        if status != 200:
            return False
        conditions = (json.loads(body).get("status") or {}).get("conditions") or []
        return any(c["type"] == "Ready" and c["status"] == "True" for c in conditions)

    @property
    def prometheus_targets(self) -> Path:
        """Drop a file_sd JSON file here to have Prometheus scrape a target."""
        return self.home / "prometheus" / "targets"

    def _prometheus_config(self) -> Path:
        path = self.home / "prometheus" / "prometheus.yml"
        self.prometheus_targets.mkdir(parents=True, exist_ok=True)
        config = {
            "global": {"scrape_interval": "2s", "evaluation_interval": "5s"},
            "scrape_configs": [
                {"job_name": "prometheus",
                 "static_configs": [{"targets": [f"127.0.0.1:{self.ports['prometheus']}"]}]},
                # Prometheus is built without Kubernetes service discovery (build.sh), so the
                # kubelet writes pods annotated prometheus.io/scrape=true into this directory.
                {"job_name": "files", "file_sd_configs": [
                    {"files": [str(self.prometheus_targets / "*.json")], "refresh_interval": "2s"}]},
            ],
        }
        path.write_text(json.dumps(config, indent=1))  # JSON is YAML
        return path

    # ---- up / down / status -------------------------------------------------------------------
    def _pid_file(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def _prepare(self) -> None:
        for name in ["etcd", "s3", "prometheus/data", "apiserver"]:
            (self.home / name).mkdir(parents=True, exist_ok=True)
        certs.ensure_pki(self.pki)
        for client in certs.CLIENTS:
            certs.write_kubeconfig(self.kubeconfig(client), self.server, self.pki, client)

    def _start(self, component: Component) -> None:
        start = time.monotonic()
        if processes.running(self._pid_file(component.name)):
            state = "running"
        else:
            env = {**os.environ, **component.env()}
            processes.spawn(component.argv(), self.logs / f"{component.name}.log", self._pid_file(component.name),
                            env=env, cwd=self.home)
            state = "started"
        deadline = start + component.timeout
        while not component.ready():
            if not processes.running(self._pid_file(component.name)):
                raise NotReady(f"{component.name} exited; see {self.logs / (component.name + '.log')}")
            if time.monotonic() > deadline:
                raise NotReady(f"{component.name} not ready after {component.timeout:.0f} s; "
                               f"see {self.logs / (component.name + '.log')}")
            time.sleep(0.2)
        self.log(f"{component.name:24} {state}, ready in {time.monotonic() - start:.1f} s")

    def up(self) -> None:
        """Start whatever is not running and wait until every part is ready."""
        # Fail early, with the build hint, when a binary is missing.
        for binary in ["etcd", "kube-apiserver", "kube-controller-manager", "kubectl", "helm",
                       "training-operator.v1", "versitygw", "prometheus", *(c.binary for c in CONTROLLERS)]:
            versions.binary(binary)
        start = time.monotonic()
        self._prepare()
        self.log(f"{'certificates':24} ready in {time.monotonic() - start:.1f} s")
        by_name = {c.name: c for c in self.components}
        self._start(by_name["etcd"])
        self._start(by_name["kube-apiserver"])
        # CRDs go in before the controller manager: its garbage collector re-reads discovery only
        # every 30 s, so resources it has not seen yet would keep their orphans that long.
        start = time.monotonic()
        established = self._install_crds()
        self.log(f"{'CRDs':24} {established} established in {time.monotonic() - start:.1f} s")
        self._start(by_name["kube-controller-manager"])
        self._prepare_training_operator()
        self._start(by_name["training-operator"])
        self._ensure_namespace(KUEUE_NAMESPACE)
        for controller in CONTROLLERS:
            self._start(by_name[controller.name])
            # Registered once the controller answers: with failurePolicy Fail, a webhook that
            # nobody serves would refuse every request it matches.
            start = time.monotonic()
            configurations = controller.webhook_configurations(self.ports[f"{controller.name}_webhook"], self._ca)
            self._apply(configurations + controller.public_objects())
            self.log(f"{controller.name + ' webhooks':24} {sum(len(c['webhooks']) for c in configurations)} "
                     f"registered in {time.monotonic() - start:.1f} s")
        for name in ["s3", "prometheus", "kubelet"]:
            self._start(by_name[name])

    @property
    def _ca(self) -> str:
        return ca_bundle(self.pki / "ca.crt")

    def _apply(self, objects: list[dict]) -> list[str]:
        """Server-side apply OBJECTS in one kubectl call; returns `kind.group/name` of each."""
        applied = self.kubectl("apply", "--server-side", "--force-conflicts", "-o", "name", "-f", "-",
                               input=json.dumps({"apiVersion": "v1", "kind": "List", "items": objects}))
        return applied.stdout.split()

    def _ensure_namespace(self, name: str) -> None:
        self._apply([{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}])

    def _install_crds(self) -> int:
        own = versions.training_operator_crds() + sorted(REPO_CRDS.glob("*.yaml"))
        crds = [yaml.safe_load(f.read_text()) for f in own]
        for controller in CONTROLLERS:
            crds += controller.crds(self.ports[f"{controller.name}_webhook"], self._ca)
        names = [line.split("/", 1)[1] for line in self._apply(crds)]
        deadline = time.monotonic() + 60
        for name in names:
            while not self._crd_established(name):
                if time.monotonic() > deadline:
                    raise NotReady(f"CRD {name} not Established after 60 s")
                time.sleep(0.2)
        return len(names)

    def _crd_established(self, name: str) -> bool:
        status, body = self.api_get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
        # Right after creation the CRD has no conditions at all (null), not an empty list.
        conditions = (json.loads(body).get("status") or {}).get("conditions") if status == 200 else None
        return any(c["type"] == "Established" and c["status"] == "True" for c in conditions or [])

    # ---- the training operator ----------------------------------------------------------------
    # v1.9 always runs its certificate rotator: it fills the Secret below with a CA and a serving
    # certificate, then waits until those files appear in its fixed certificate directory, where
    # a real kubelet would mount the Secret. Here the operator runs in the sandbox with a state
    # directory bind-mounted there, and `up` copies the Secret's files into it. Its
    # ValidatingWebhookConfiguration is left out on purpose: the API server never calls a
    # webhook that listens outside loopback.
    WEBHOOK_SECRET = "training-operator-webhook-cert"
    WEBHOOK_CERT_DIR = "/tmp/k8s-webhook-server/serving-certs"

    def _prepare_training_operator(self) -> None:
        """The namespace and the (empty) webhook-certificate Secret the operator requires."""
        manifest = {
            "apiVersion": "v1", "kind": "List", "items": [
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "kubeflow"}},
                {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                 "metadata": {"name": self.WEBHOOK_SECRET, "namespace": "kubeflow"}},
            ]}
        # create, not apply: a re-run of `up` must keep the certificates the operator wrote.
        result = self.kubectl("create", "-f", "-", input=json.dumps(manifest), check=False)
        if result.returncode != 0 and "AlreadyExists" not in result.stderr:
            raise NotReady(f"kubeflow namespace: {result.stderr}")

    def _training_operator_argv(self) -> list[str]:
        p = self.ports
        spec = {
            "mounts": [{"source": str(self._webhook_certs), "target": self.WEBHOOK_CERT_DIR, "readOnly": True}],
            "workingDir": str(self.home),
            "argv": [str(versions.binary("training-operator.v1")), "--enable-scheme=pytorchjob",
                     f"--metrics-bind-address=127.0.0.1:{p['operator_metrics']}",
                     f"--health-probe-bind-address=127.0.0.1:{p['operator_health']}",
                     f"--webhook-server-port={p['operator_webhook']}"],
            "env": {"KUBECONFIG": str(self.kubeconfig("training-operator")), "PATH": os.environ.get("PATH", "")},
        }
        spec_file = self.home / "training-operator" / "sandbox.json"
        spec_file.write_text(json.dumps(spec, indent=1))
        return [sys.executable, "-m", "kubetune_dev.sandbox", str(spec_file)]

    @property
    def _webhook_certs(self) -> Path:
        path = self.home / "training-operator" / "serving-certs"
        path.mkdir(parents=True, exist_ok=True)
        return path

    def _training_operator_ready(self) -> bool:
        status, body = self.api_get(f"/api/v1/namespaces/kubeflow/secrets/{self.WEBHOOK_SECRET}")
        data = json.loads(body).get("data") or {} if status == 200 else {}
        for key in ("ca.crt", "tls.crt", "tls.key"):
            if key not in data:
                return False
        for key, value in data.items():
            path = self._webhook_certs / key
            content = base64.b64decode(value)
            if not path.exists() or path.read_bytes() != content:
                path.write_bytes(content)
                path.chmod(0o600)
        return self._get(f"http://127.0.0.1:{self.ports['operator_health']}/readyz")[0] == 200

    # ---- JobSet, Trainer, Kueue (controllers.py) --------------------------------------------------
    def _controller_argv(self, controller: Controller) -> list[str]:
        state = self.home / controller.name
        cert_dir = certs.serving_cert_dir(self.pki, state / "certs")
        config = controller.configuration(self.ports[f"{controller.name}_webhook"],
                                          self.ports[f"{controller.name}_health"], str(cert_dir))
        (state / "config.yaml").write_text(yaml.safe_dump(config, sort_keys=False))
        argv = [str(versions.binary(controller.binary)), f"--config={state / 'config.yaml'}"]
        if not controller.cert_mounts:
            return argv
        spec = {"mounts": [{"source": str(cert_dir), "target": target, "readOnly": True}
                           for target in controller.cert_mounts],
                "workingDir": str(self.home), "argv": argv,
                "env": {"KUBECONFIG": str(self.kubeconfig(controller.name)), "PATH": os.environ.get("PATH", "")}}
        (state / "sandbox.json").write_text(json.dumps(spec, indent=1))
        return [sys.executable, "-m", "kubetune_dev.sandbox", str(state / "sandbox.json")]

    def _controller_ready(self, controller: Controller) -> bool:
        # Each one reports ready only once its webhook server is listening.
        return self._get(f"http://127.0.0.1:{self.ports[controller.name + '_health']}/readyz")[0] == 200

    def down(self) -> None:
        """Stop the kubelet first (it stops its pods), then the rest in reverse start order."""
        for component in reversed(self.components):
            proc = processes.running(self._pid_file(component.name))
            if proc is not None:
                processes.stop(proc, grace=20 if component.name == "kubelet" else 10)
                self.log(f"{component.name:24} stopped")
        # Containers the kubelet could not stop (it was killed): their pid files remain.
        for pid_file in self.kubelet_state.glob("pods/*/pids/*.json"):
            proc = processes.running(pid_file)
            if proc is not None:
                processes.stop(proc, grace=5)
                self.log(f"leftover container {pid_file.parent.parent.name}/{pid_file.stem} stopped")

    def status(self) -> dict[str, int | None]:
        """Component name -> pid when running, else None."""
        result = {}
        for component in self.components:
            proc = processes.running(self._pid_file(component.name))
            result[component.name] = proc.pid if proc else None
        return result

    def pod_pids(self) -> set[int]:
        """Every process of every running container (the kubelet's children and theirs)."""
        roots = [proc.pid for f in self.kubelet_state.glob("pods/*/pids/*.json") if (proc := processes.running(f))]
        return set().union(*(tree(root) for root in roots))

    def pids(self) -> list[int]:
        """Every process of the control plane: components, their children and the pods."""
        roots = [p for p in self.status().values() if p]
        return sorted(self.pod_pids().union(*(tree(root) for root in roots)))

    def pod_dirs(self, namespace: str, pod_pattern: str) -> list[Path]:
        """The kubelet's directories of the pods whose names match POD_PATTERN (a glob), oldest first.

        Ordered by the pod's start (its address file, written once when the kubelet starts it), not by
        the directory's own time: the kubelet removes a finished pod's volumes later, which moves that.
        """
        dirs = [d for d in self.kubelet_state.glob(f"pods/{namespace}_{pod_pattern}_*") if (d / "ip").exists()]
        return sorted(dirs, key=lambda d: (d / "ip").stat().st_mtime_ns)

    def pod_log(self, pod: str, namespace: str, container: str | None) -> Path:
        """The log file of a container (the newest pod of that name; the only container by default)."""
        dirs = self.pod_dirs(namespace, pod)
        if not dirs:
            component_log = self.logs / f"{pod}.log"
            if component_log.exists():  # `kubetune dev logs kube-apiserver` works too
                return component_log
            raise FileNotFoundError(f"no pod {namespace}/{pod} has run on this control plane")
        logs = sorted((dirs[-1] / "logs").glob("*.log"))
        if container:
            logs = [f for f in logs if f.stem == container]
        if len(logs) != 1:
            names = ", ".join(f.stem for f in sorted((dirs[-1] / 'logs').glob('*.log')))
            raise FileNotFoundError(f"pick a container with -c (containers: {names})")
        return logs[0]


def rss_bytes(pids: list[int] | set[int]) -> int:
    """Resident memory of PIDS (VmRSS from /proc, summed); vanished processes count as 0."""
    total = 0
    for pid in pids:
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            continue
    return total


def tree(pid: int) -> set[int]:
    """PID and all its descendants."""
    return {pid} | _descendants(pid)


def _descendants(pid: int) -> set[int]:
    children = set()
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            children |= {int(c) for c in (task / "children").read_text().split()}
        except OSError:
            continue
    return children | {d for c in children for d in _descendants(c)}
