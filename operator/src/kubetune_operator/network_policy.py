"""The NetworkPolicy the operator creates beside each TrainingJob's child job (Helm value
networkPolicy.enabled), owned by the TrainingJob so it goes with it.

It selects the job's trainer pods and lets them talk to each other on any port (the rendezvous
and the collective library's ports are chosen at run time), receive scrapes of their metrics port
from the operator and from the sources the chart names, resolve names, and reach only the
destinations the chart names (S3, the model hub: by default any address on 443 and 80), and push
their progress to the operator's inbox port. Nothing
else reaches them, and they reach nothing else: not other jobs' pods, not the API server (the
trainer never calls it). A pure function of the job and the settings.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from kubetune_api.spec import TrainingJob
from kubetune_operator import naming

DNS_PORTS = [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]


@dataclass(frozen=True)
class NetworkPolicySettings:
    """What the chart tells the operator (env KUBETUNE_NETWORK_POLICY, JSON)."""

    operator_namespace: str
    operator_labels: dict[str, str]
    # NetworkPolicyPeers that may scrape the trainers' metrics besides the operator (e.g. Prometheus); [] = any.
    metrics_from: list[dict] = field(default_factory=list)
    # NetworkPolicyEgressRules for the trainers beyond their own job and DNS.
    egress: list[dict] = field(default_factory=list)
    # The operator's progress inbox port (Helm value operator.progressPush.port); None = no push.
    progress_port: int | None = None

    @classmethod
    def from_json(cls, text: str) -> "NetworkPolicySettings | None":
        if not text:
            return None
        try:
            raw = json.loads(text)
            return cls(operator_namespace=raw["operatorNamespace"], operator_labels=dict(raw["operatorLabels"]),
                       metrics_from=list(raw.get("metricsFrom") or []), egress=list(raw.get("egress") or []),
                       progress_port=int(raw["progressPort"]) if raw.get("progressPort") else None)
        except (ValueError, KeyError, TypeError) as err:
            raise ValueError(f"KUBETUNE_NETWORK_POLICY (Helm values networkPolicy.*) is not valid: {err}") from None


def name(job_name: str) -> str:
    return f"{naming.child_name(job_name)}-trainers"


def trainer_network_policy(job: TrainingJob, policy: NetworkPolicySettings, metrics_port: int) -> dict:
    """The NetworkPolicy for JOB's trainer pods."""
    own_pods = {"matchLabels": naming.labels(job.metadata.name)}
    same_job = [{"podSelector": own_pods}]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": policy.operator_namespace}},
                "podSelector": {"matchLabels": policy.operator_labels}}
    metrics = [{"port": metrics_port, "protocol": "TCP"}]
    ingress = [{"from": same_job}, {"from": [operator], "ports": metrics}]
    # No peers named: anyone may scrape (a peer list of [] would mean nobody in a NetworkPolicy's eyes).
    ingress.append({"from": policy.metrics_from, "ports": metrics} if policy.metrics_from else {"ports": metrics})
    # Rank 0 pushes its progress to the operator's pods (through the progress Service: a
    # NetworkPolicy sees the pods behind it).
    push = ([{"to": [operator], "ports": [{"port": policy.progress_port, "protocol": "TCP"}]}]
            if policy.progress_port else [])
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name(job.metadata.name), "namespace": job.metadata.namespace,
                     "labels": naming.labels(job.metadata.name)},
        "spec": {
            "podSelector": own_pods,
            "policyTypes": ["Ingress", "Egress"],
            "ingress": ingress,
            "egress": [{"to": same_job}, {"ports": DNS_PORTS}, *push, *policy.egress],
        },
    }
