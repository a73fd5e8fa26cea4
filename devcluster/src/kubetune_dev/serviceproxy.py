"""The process kubelet's kube-proxy: a Service's cluster IP and port forward to a pod that serves it.

The local control plane allocates cluster IPs in 127.2.0.0/16 (cluster.py), so they are loopback
addresses any process can listen on. For every ClusterIP Service with a selector, the kubelet
listens on clusterIP:port (TCP) and forwards each connection to a ready pod it selects, at the
target port (a number, or a container port's name). This is what lets the API server call an
admission webhook through its Service (clientConfig.service), as in a real cluster: the API
server resolves the Service to its cluster IP itself, and Endpoints, which refuse loopback
addresses, play no part.

`routes` is a pure function of the pods and services (unit-tested); `ServiceProxy` opens and
closes the listeners to match it.
"""
from __future__ import annotations

import logging
import socket
import threading

log = logging.getLogger("serviceproxy")

Route = tuple[str, int]  # (ip, port)


def _ready(pod: dict) -> bool:
    status = pod.get("status") or {}
    return bool(status.get("podIP")) and any(
        c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])


def _target_port(pod: dict, target) -> int | None:
    if isinstance(target, int):
        return target
    if isinstance(target, str) and target.isdigit():
        return int(target)
    for container in pod["spec"].get("containers") or []:
        for port in container.get("ports") or []:
            if port.get("name") == target and port.get("protocol", "TCP") == "TCP":
                return int(port["containerPort"])
    return None


def routes(services: list[dict], pods: list[dict]) -> dict[Route, Route]:
    """{(clusterIP, port): (podIP, targetPort)} for every TCP port of every ClusterIP Service with a
    selector and a ready pod behind it (the first by name: one backend is enough here)."""
    table: dict[Route, Route] = {}
    for service in services:
        spec, namespace = service.get("spec") or {}, service["metadata"]["namespace"]
        cluster_ip, selector = spec.get("clusterIP"), spec.get("selector")
        if not selector or not cluster_ip or cluster_ip == "None" or spec.get("type", "ClusterIP") != "ClusterIP":
            continue
        backends = sorted((p for p in pods if p["metadata"]["namespace"] == namespace and _ready(p)
                           and all((p["metadata"].get("labels") or {}).get(k) == v for k, v in selector.items())),
                          key=lambda p: p["metadata"]["name"])
        for port in spec.get("ports") or []:
            if port.get("protocol", "TCP") != "TCP":
                continue
            for pod in backends:
                target = _target_port(pod, port.get("targetPort", port["port"]))
                if target is not None:
                    table[(cluster_ip, int(port["port"]))] = (pod["status"]["podIP"], target)
                    break
    return table


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for s in (sink, source):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


class ServiceProxy:
    """Listeners on cluster IPs, each forwarding to the backend its route names now."""

    def __init__(self):
        self.routes: dict[Route, Route] = {}
        self.listeners: dict[Route, socket.socket] = {}

    def update(self, table: dict[Route, Route]) -> None:
        self.routes = dict(table)
        for front in list(self.listeners):
            if front not in table:
                listener = self.listeners.pop(front)
                # shutdown wakes the thread blocked in accept(); close alone leaves it listening.
                try:
                    listener.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
                listener.close()
                log.info("stopped forwarding %s:%d", *front)
        for front in table:
            if front not in self.listeners:
                self._listen(front)

    def _listen(self, front: Route) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind(front)
        except OSError as err:
            log.warning("cannot listen on service address %s:%d: %s", *front, err)
            listener.close()
            return
        listener.listen(64)
        self.listeners[front] = listener
        threading.Thread(target=self._accept, args=(front, listener), daemon=True).start()
        log.info("forwarding %s:%d to %s:%d", *front, *self.routes[front])

    def _accept(self, front: Route, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:  # closed by update() or close()
                return
            backend = self.routes.get(front)
            try:
                if backend is None:
                    raise OSError("no ready backend")
                upstream = socket.create_connection(backend, timeout=5)
                upstream.settimeout(None)
            except OSError as err:
                log.info("connection to %s:%d refused: %s", *front, err)
                client.close()
                continue
            threading.Thread(target=_pipe, args=(client, upstream), daemon=True).start()
            threading.Thread(target=_pipe, args=(upstream, client), daemon=True).start()

    def close(self) -> None:
        self.update({})
