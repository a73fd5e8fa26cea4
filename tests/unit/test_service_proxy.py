"""The process kubelet's service proxy: which pod a Service's cluster IP and port lead to, and a
real TCP connection through it."""
from __future__ import annotations

import socket
import threading

from kubetune_dev import serviceproxy


def pod(name, ip, labels, ready=True, namespace="ns", ports=(("webhook", 9443),)):
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels},
            "spec": {"containers": [{"ports": [{"name": n, "containerPort": p} for n, p in ports]}]},
            "status": {"podIP": ip, "conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}}


def service(name, cluster_ip, selector, ports, namespace="ns", **spec):
    return {"metadata": {"name": name, "namespace": namespace},
            "spec": {"clusterIP": cluster_ip, "selector": selector, "ports": ports, **spec}}


def test_a_service_port_leads_to_a_ready_selected_pod_at_its_named_or_numbered_target():
    pods = [pod("op-b", "127.1.0.3", {"app": "op"}), pod("op-a", "127.1.0.2", {"app": "op"}, ready=False),
            pod("other", "127.1.0.4", {"app": "other"}), pod("op-c", "127.1.0.5", {"app": "op"}, namespace="elsewhere")]
    services = [service("webhook", "127.2.0.10", {"app": "op"},
                        [{"port": 443, "targetPort": "webhook"}, {"port": 8080, "targetPort": 8081}]),
                service("headless", "None", {"app": "op"}, [{"port": 1}]),
                service("no-selector", "127.2.0.11", None, [{"port": 1}]),
                service("unnamed-target", "127.2.0.12", {"app": "op"}, [{"port": 9, "targetPort": "missing"}]),
                service("dns-name", "", {"app": "op"}, [{"port": 1}], type="ExternalName")]
    assert serviceproxy.routes(services, pods) == {("127.2.0.10", 443): ("127.1.0.3", 9443),
                                                   ("127.2.0.10", 8080): ("127.1.0.3", 8081)}
    assert serviceproxy.routes(services, [pods[1]]) == {}, "a pod that is not ready gets no traffic"


def test_connections_to_the_cluster_ip_reach_the_pod_and_stop_when_the_service_goes():
    backend = socket.socket()
    backend.bind(("127.1.0.77", 0))
    backend.listen()
    backend_port = backend.getsockname()[1]

    def echo_once():
        conn, _ = backend.accept()
        conn.sendall(b"pod says " + conn.recv(100))
        conn.close()

    threading.Thread(target=echo_once, daemon=True).start()
    probe = socket.socket()
    probe.bind(("127.2.0.77", 0))
    front_port = probe.getsockname()[1]
    probe.close()

    proxy = serviceproxy.ServiceProxy()
    try:
        proxy.update({("127.2.0.77", front_port): ("127.1.0.77", backend_port)})
        with socket.create_connection(("127.2.0.77", front_port), timeout=5) as conn:
            conn.sendall(b"hello")
            assert conn.recv(100) == b"pod says hello"
        proxy.update({})
        try:
            socket.create_connection(("127.2.0.77", front_port), timeout=2).close()
            raise AssertionError("the listener outlived its Service")
        except ConnectionRefusedError:
            pass
    finally:
        proxy.close()
        backend.close()
