"""The process kubelet: one Node whose pods run as local processes.

    python -m kubetune_dev.kubelet --kubeconfig K --state DIR --api-port P

Each second it reconciles the API's view with the processes it runs:
  * registers its Node and keeps its Ready condition fresh;
  * binds pods nobody scheduled to itself (one node, so the scheduler is one line);
  * starts a PodRunner for each new pod bound to it, giving it the next 127.x.y.z address;
  * on deletion, stops the pod (SIGTERM, SIGKILL after the grace period) and then removes it
    from the API, which is the kubelet's part in graceful deletion;
  * rewrites every running pod's hosts file from the current pods and services;
  * forwards each Service's cluster IP and port to a ready pod it selects (serviceproxy.py);
  * serves the kubelet's API on its port for the API server (`kubectl logs`: kubelet_api.py);
  * lists pods annotated `prometheus.io/scrape: "true"` (port and path from `prometheus.io/port`
    and `prometheus.io/path`) as Prometheus file_sd targets, standing in for Kubernetes service
    discovery.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import signal
import threading
from pathlib import Path

from kubernetes import client, config
from kubernetes.client.rest import ApiException

from kubetune_dev import container_runtime, hosts, processes, serviceproxy
from kubetune_dev.kubelet_api import KubeletAPI
from kubetune_dev.podrunner import POD_DIR_LABEL, PodRunner, now
from kubetune_dev.volumes import unschedulable_claims

log = logging.getLogger("kubelet")
NODE_NAME = "kubetune-dev"
RECORD = "kubelet.json"  # in its state directory: the running kubelet's pid and start time
TERMINAL = ("Succeeded", "Failed")


class Addresses:
    """Pod IPs 127.1.0.1, 127.1.0.2, …: a persisted counter, never reused within a state dir."""

    def __init__(self, path: Path):
        self.path = path

    def next(self) -> str:
        n = int(self.path.read_text()) if self.path.exists() else 0
        self.path.write_text(str(n + 1))
        # Skip .0 and .255 in the last octet; 127.1.0.0/16 leaves room for 65k pods.
        return f"127.1.{(n // 254) % 256}.{n % 254 + 1}"


class Kubelet:
    def __init__(self, api: client.CoreV1Api, state: Path, api_port: int, prometheus_targets: Path | None = None,
                 node_port: int | None = None, pki: Path | None = None):
        """NODE_PORT: where the kubelet's API listens, with PKI's serving certificate (None: no API)."""
        self.api, self.state, self.prometheus_targets = api, state, prometheus_targets
        self.node_api = KubeletAPI(node_port, pki, self.find_pod) if node_port else None
        self.pods_dir = state / "pods"
        self.pods_dir.mkdir(parents=True, exist_ok=True)
        self.addresses = Addresses(state / "next-pod-ip")
        self.runners: dict[str, PodRunner] = {}  # pod uid -> runner
        self.base_env = {"HOME": "/root", "KUBERNETES_SERVICE_HOST": "127.0.0.1",
                         "KUBERNETES_SERVICE_PORT": str(api_port), "KUBERNETES_SERVICE_PORT_HTTPS": str(api_port),
                         "KUBERNETES_PORT": f"tcp://127.0.0.1:{api_port}"}
        self.stopped = threading.Event()
        self._last_heartbeat = 0.0
        self.proxy = serviceproxy.ServiceProxy()

    # ---- node ---------------------------------------------------------------------------------
    def register(self) -> None:
        node = {"apiVersion": "v1", "kind": "Node",
                "metadata": {"name": NODE_NAME, "labels": {"kubernetes.io/hostname": NODE_NAME,
                                                           "kubernetes.io/os": "linux",
                                                           "kubernetes.io/arch": "amd64" if platform.machine() == "x86_64" else platform.machine()}}}
        try:
            self.api.create_node(node, _preload_content=False)
        except ApiException as e:
            if e.status != 409:
                raise
        self.heartbeat()

    def heartbeat(self) -> None:
        memory = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        capacity = {"cpu": str(os.cpu_count()), "memory": f"{memory // 1024}Ki", "pods": "110"}
        status = {"capacity": capacity, "allocatable": capacity,
                  "addresses": [{"type": "InternalIP", "address": "127.0.0.1"},
                                {"type": "Hostname", "address": NODE_NAME}],
                  "daemonEndpoints": {"kubeletEndpoint": {"Port": self.node_api.server_port if self.node_api else 0}},
                  "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady",
                                  "message": "process kubelet is posting ready status",
                                  "lastHeartbeatTime": now(), "lastTransitionTime": now()}],
                  "nodeInfo": {"kubeletVersion": "process-kubelet", "operatingSystem": "linux",
                               "architecture": platform.machine(), "containerRuntimeVersion": "process://",
                               "kernelVersion": platform.release(), "osImage": platform.platform(),
                               "machineID": "", "systemUUID": "", "bootID": "", "kubeProxyVersion": ""}}
        self.api.patch_node_status(NODE_NAME, {"status": status}, _content_type="application/merge-patch+json")

    # ---- the loop -----------------------------------------------------------------------------
    def run(self) -> None:
        processes.record(os.getpid(), self.state / RECORD)  # that this kubelet runs (remove_orphaned_containers)
        self._kill_leftovers()
        if self.node_api is not None:
            self.node_api.start()
        self.register()
        self.sync()
        (self.state / "ready").write_text(str(os.getpid()))
        ticks = 0
        while not self.stopped.wait(1.0):
            ticks += 1
            try:
                self.sync()
                if ticks % 10 == 0:
                    self.heartbeat()
            except Exception:
                log.exception("sync failed; retrying")
        self.shutdown()

    def _list(self, call) -> list[dict]:
        return json.loads(call(_preload_content=False).data)["items"]

    def sync(self) -> None:
        pods = self._list(self.api.list_pod_for_all_namespaces)
        seen = set()
        for pod in pods:
            meta, spec = pod["metadata"], pod["spec"]
            uid = meta["uid"]
            if not spec.get("nodeName"):
                if spec.get("schedulerName", "default-scheduler") == "default-scheduler" and not meta.get("deletionTimestamp"):
                    self.schedule(pod)
                continue
            if spec["nodeName"] != NODE_NAME:
                continue
            seen.add(uid)
            runner = self.runners.get(uid)
            deleting = meta.get("deletionTimestamp") is not None
            if runner is None and not deleting and (pod.get("status") or {}).get("phase") not in TERMINAL:
                self.start(pod)
            elif deleting:
                if runner is not None:
                    runner.stop(float(meta.get("deletionGracePeriodSeconds") or 0))
                if runner is None or runner.finished:
                    self.finalize_deletion(pod)
        # Pods removed from the API outright (force deletion): stop them at once.
        for uid in list(self.runners):
            if uid not in seen:
                self.runners[uid].stop(0)
                if self.runners[uid].finished:
                    self._forget(uid)
        self.write_hosts(pods)

    def schedule(self, pod: dict) -> None:
        """Bind POD to this node, or, as kube-scheduler does, leave it pending with PodScheduled=False
        and the reason (a claim that does not exist or is not bound)."""
        waiting = unschedulable_claims(self.api, pod)
        if waiting is None:
            self.bind(pod)
            return
        conditions = (pod.get("status") or {}).get("conditions") or []
        scheduled = next((c for c in conditions if c["type"] == "PodScheduled"), {})
        if scheduled.get("message") != waiting:
            condition = {"type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": waiting,
                         "lastTransitionTime": now()}
            meta = pod["metadata"]
            self.api.patch_namespaced_pod_status(meta["name"], meta["namespace"],
                                                 {"status": {"conditions": [condition]}})
            log.info("%s/%s unschedulable: %s", meta["namespace"], meta["name"], waiting)

    def bind(self, pod: dict) -> None:
        meta = pod["metadata"]
        binding = {"apiVersion": "v1", "kind": "Binding", "metadata": {"name": meta["name"]},
                   "target": {"apiVersion": "v1", "kind": "Node", "name": NODE_NAME}}
        try:
            self.api.create_namespaced_pod_binding(meta["name"], meta["namespace"], binding, _preload_content=False)
            log.info("bound %s/%s to %s", meta["namespace"], meta["name"], NODE_NAME)
        except ApiException as e:
            if e.status != 409:  # already bound by a previous pass
                raise

    def start(self, pod: dict) -> None:
        meta = pod["metadata"]
        pod_dir = self.pods_dir / f"{meta['namespace']}_{meta['name']}_{meta['uid']}"
        pod_dir.mkdir(parents=True, exist_ok=True)
        ip_file = pod_dir / "ip"
        if not ip_file.exists():  # written once: its time is the pod's start (Cluster.pod_dirs)
            ip_file.write_text(self.addresses.next())
        runner = PodRunner(self.api, pod, pod_dir, ip_file.read_text(), self.base_env)
        # The pod's address is published before any container runs, so names resolve early.
        runner.pod.setdefault("status", {})["podIP"] = runner.ip
        runner.hosts_file.touch()
        self.runners[meta["uid"]] = runner
        log.info("starting %s/%s at %s", meta["namespace"], meta["name"], runner.ip)
        runner.start()

    def finalize_deletion(self, pod: dict) -> None:
        meta = pod["metadata"]
        try:
            # Options go in the body: with a body, the API server ignores query parameters.
            self.api.delete_namespaced_pod(meta["name"], meta["namespace"], _preload_content=False,
                                           body={"gracePeriodSeconds": 0, "preconditions": {"uid": meta["uid"]}})
            log.info("deleted %s/%s", meta["namespace"], meta["name"])
        except ApiException as e:
            if e.status not in (404, 409):
                raise
        self._forget(meta["uid"])

    def find_pod(self, namespace: str, name: str) -> PodRunner | None:
        """The pod NAMESPACE/NAME this kubelet runs or ran, while the API still holds it (for its API)."""
        return next((runner for runner in list(self.runners.values())
                     if runner.meta["namespace"] == namespace and runner.meta["name"] == name), None)

    def _forget(self, uid: str) -> None:
        runner = self.runners.pop(uid, None)
        if runner is not None:
            shutil.rmtree(runner.dir / "volumes", ignore_errors=True)

    def write_hosts(self, pods: list[dict]) -> None:
        """Names (hosts files) and service addresses (the proxy) for the pods running now."""
        services = self._list(self.api.list_service_for_all_namespaces)
        live = []
        for pod in pods:
            runner = self.runners.get(pod["metadata"]["uid"])
            if runner is not None and not runner.finished:
                pod = {**pod, "status": {**(pod.get("status") or {}), "podIP": runner.ip}}
                live.append((pod, runner))
        for pod, runner in live:
            hosts.write_in_place(runner.hosts_file, hosts.render(pod, [p for p, _ in live], services))
        self.proxy.update(serviceproxy.routes(services, [p for p, _ in live]))
        if self.prometheus_targets is not None:
            self.write_scrape_targets([pod for pod, _ in live])

    def write_scrape_targets(self, pods: list[dict]) -> None:
        targets = []
        for pod in pods:
            meta = pod["metadata"]
            annotations = meta.get("annotations") or {}
            if annotations.get("prometheus.io/scrape") == "true" and annotations.get("prometheus.io/port"):
                # __metrics_path__ is Prometheus's own label for the path it scrapes.
                targets.append({"targets": [f"{pod['status']['podIP']}:{annotations['prometheus.io/port']}"],
                                "labels": {"namespace": meta["namespace"], "pod": meta["name"],
                                           "__metrics_path__": annotations.get("prometheus.io/path", "/metrics")}})
        path = self.prometheus_targets / "kubelet-pods.json"
        content = json.dumps(targets, indent=1)
        if not path.exists() or path.read_text() != content:
            tmp = path.with_suffix(".tmp")
            tmp.write_text(content)
            tmp.replace(path)  # atomic: Prometheus never reads half a file

    # ---- shutdown -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every pod (kubelet exit means its containers go too: nothing outlives `dev down`)."""
        self.proxy.close()
        if self.node_api is not None:
            self.node_api.close()
        for runner in self.runners.values():
            runner.stop(5)
        for runner in self.runners.values():
            runner.join(timeout=10)
        self._kill_leftovers()

    def _kill_leftovers(self) -> None:
        """Containers recorded by an earlier kubelet process that are still running."""
        for pid_file in self.pods_dir.glob("*/pids/*.json"):
            proc = processes.running(pid_file)
            if proc is not None:
                processes.stop(proc, grace=5)
        if shutil.which("podman"):  # real containers outlive their killed podman processes
            remove_orphaned_containers(self.pods_dir)


def remove_orphaned_containers(own_pods_dir: Path) -> list[str]:
    """Remove the real containers of OWN_PODS_DIR, and those of every kubelet that no longer runs (a test
    session killed with its control plane leaves its containers running under conmon, using the CPU);
    a running kubelet's are left alone. Returns the ids removed."""
    removed = []
    for pods_dir, containers in container_runtime.labelled(POD_DIR_LABEL).items():
        if pods_dir == str(own_pods_dir) or processes.running(Path(pods_dir).parent / RECORD) is None:
            for container in containers:
                container_runtime.remove(container)
            removed += containers
    return removed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--kubeconfig", required=True)
    parser.add_argument("--state", required=True, type=Path)
    parser.add_argument("--api-port", required=True, type=int)
    parser.add_argument("--prometheus-targets", type=Path, help="file_sd directory for annotated pods")
    parser.add_argument("--port", type=int, required=True, help="the kubelet's API (kubelet_api.py)")
    parser.add_argument("--pki", type=Path, required=True, help="its serving certificate and the CA it trusts")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    api = client.CoreV1Api(config.new_client_from_config(config_file=args.kubeconfig))
    kubelet = Kubelet(api, args.state, args.api_port, args.prometheus_targets, args.port, args.pki)
    signal.signal(signal.SIGTERM, lambda *_: kubelet.stopped.set())
    signal.signal(signal.SIGINT, lambda *_: kubelet.stopped.set())
    kubelet.run()


if __name__ == "__main__":
    main()
