"""A pod's hosts file resolves what cluster DNS would: services, and pods by hostname.subdomain."""
from __future__ import annotations

from kubetune_dev import hosts


def pod(name: str, ip: str, namespace: str = "team", labels: dict | None = None, **spec) -> dict:
    return {"metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
            "spec": spec, "status": {"podIP": ip}}


def headless(name: str, namespace: str, selector: dict) -> dict:
    return {"metadata": {"name": name, "namespace": namespace}, "spec": {"clusterIP": "None", "selector": selector}}


def lookup(hosts_file: str) -> dict[str, str]:
    table = {}
    for line in hosts_file.splitlines():
        address, *names = line.split()
        for name in names:
            table.setdefault(name, address)
    return table


def test_jobset_pods_find_each_other_by_hostname_and_subdomain():
    """Trainer v2 sets PET_MASTER_ADDR=<job>-node-0-0.<job>: JobSet's pods carry that hostname and the
    subdomain of a headless Service selecting them."""
    labels = {"jobset.sigs.k8s.io/jobset-name": "train"}
    node0 = pod("train-node-0-0-abcde", "127.1.0.5", labels=labels, hostname="train-node-0-0", subdomain="train")
    node1 = pod("train-node-0-1-fghij", "127.1.0.6", labels=labels, hostname="train-node-0-1", subdomain="train")
    service = headless("train", "team", {"jobset.sigs.k8s.io/jobset-name": "train"})

    seen_by_node1 = lookup(hosts.render(node1, [node0, node1], [service]))
    for name in ("train-node-0-0.train", "train-node-0-0.train.team", "train-node-0-0.train.team.svc",
                 "train-node-0-0.train.team.svc.cluster.local"):
        assert seen_by_node1[name] == "127.1.0.5", name
    assert seen_by_node1["train-node-0-1.train"] == "127.1.0.6"
    assert seen_by_node1["train-node-0-1"] == "127.1.0.6"   # its own hostname


def test_another_namespace_sees_only_the_qualified_names():
    labels = {"app": "train"}
    node0 = pod("n0", "127.1.0.5", labels=labels, hostname="n0", subdomain="train")
    outsider = pod("other", "127.1.0.9", namespace="elsewhere")
    table = lookup(hosts.render(outsider, [node0, outsider], [headless("train", "team", labels)]))
    assert table["n0.train.team.svc"] == "127.1.0.5"
    assert "n0.train" not in table and "train" not in table


def test_a_pod_whose_subdomain_has_no_service_gets_no_record():
    """As in cluster DNS: the hostname.subdomain record exists only through a Service of that name."""
    node0 = pod("n0", "127.1.0.5", labels={"app": "x"}, hostname="n0", subdomain="missing")
    viewer = pod("viewer", "127.1.0.7")
    table = lookup(hosts.render(viewer, [node0, viewer], [headless("train", "team", {"app": "x"})]))
    assert "n0.missing" not in table and "n0.train" not in table
    assert table["train"] == "127.1.0.5"   # the Service itself still resolves to the pod it selects
