"""Name resolution for pods: one hosts file per pod, bind-mounted over its /etc/hosts.

Every pod has its own 127.x.y.z address (all of 127.0.0.0/8 is routed to the loopback device,
so nothing needs configuring). A pod's hosts file names: itself (hostname and, with a subdomain,
its FQDN), every Service in the cluster (a headless Service resolves to the pod it selects; a
ClusterIP Service too, since cluster IPs are not routable here), every pod with a hostname and a
subdomain that a Service of that name selects (cluster DNS gives such a pod the record
`<hostname>.<subdomain>.<namespace>.svc`: how JobSet's pods, hence Trainer v2's PET_MASTER_ADDR
`<job>-node-0-0.<job>`, find each other; the search path's short forms are listed too, as a hosts
file gets no search domains) and the API server as `kubernetes.default.svc`. The kubelet rewrites the files in place as pods and services change,
so a bind mount keeps seeing the current content.
"""
from __future__ import annotations

from pathlib import Path

CLUSTER_DOMAIN = "cluster.local"
_HEADER = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"


def _selects(selector: dict | None, labels: dict | None) -> bool:
    return bool(selector) and all((labels or {}).get(k) == v for k, v in selector.items())


def _names(name: str, namespace: str, own_namespace: str) -> list[str]:
    full = [f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]
    return ([name] if namespace == own_namespace else []) + full


def render(pod: dict, pods: list[dict], services: list[dict]) -> str:
    """The hosts file POD sees, given every live pod (with IPs) and every service."""
    meta, spec = pod["metadata"], pod["spec"]
    namespace = meta["namespace"]
    own_ip = pod["status"]["podIP"]
    hostname = spec.get("hostname") or meta["name"][:63]
    lines = [_HEADER]
    own = [hostname]
    if spec.get("subdomain"):
        own.insert(0, f"{hostname}.{spec['subdomain']}.{namespace}.svc.{CLUSTER_DOMAIN}")
    lines.append(f"{own_ip}\t{' '.join(own)}\n")
    lines.append(f"127.0.0.1\t{' '.join(_names('kubernetes', 'default', namespace))}\n")
    for svc in services:
        smeta = svc["metadata"]
        selector = (svc.get("spec") or {}).get("selector")
        for other in pods:
            ometa, ospec = other["metadata"], other["spec"]
            if ometa["namespace"] != smeta["namespace"] or not _selects(selector, ometa.get("labels")):
                continue
            lines.append(f"{other['status']['podIP']}\t{' '.join(_names(smeta['name'], smeta['namespace'], namespace))}\n")
            if ospec.get("hostname") and ospec.get("subdomain") == smeta["name"]:
                # The pod's own record under the Service: <hostname>.<subdomain>[.<ns>[.svc[.cluster.local]]].
                names = _names(f"{ospec['hostname']}.{smeta['name']}", smeta["namespace"], namespace)
                lines.append(f"{other['status']['podIP']}\t{' '.join(names)}\n")
    return "".join(lines)


def write_in_place(path: Path, content: str) -> None:
    """Rewrite PATH keeping its inode: a bind-mounted file only shows in-place writes."""
    if path.exists() and path.read_text() == content:
        return
    with open(path, "a+") as f:
        f.seek(0)
        f.truncate()
        f.write(content)
