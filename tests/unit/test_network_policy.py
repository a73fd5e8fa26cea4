"""The NetworkPolicy the operator creates beside each TrainingJob (networkPolicy.enabled): the job's
trainer pods talk to each other, are scraped on the metrics port, resolve names and reach only what
the chart names."""
from __future__ import annotations

import pytest

from kubetune_api.manifest import parse_manifest
from kubetune_operator.backends import PyTorchJobBackend
from kubetune_operator.network_policy import NetworkPolicySettings, trainer_network_policy
from kubetune_operator.settings import Settings

OPERATOR = {"app.kubernetes.io/name": "kubetune-operator", "app.kubernetes.io/instance": "kubetune"}
S3_ONLY = [{"to": [{"ipBlock": {"cidr": "10.20.0.0/16"}}], "ports": [{"port": 9000, "protocol": "TCP"}]}]


@pytest.fixture
def job(example_manifest):
    example_manifest["metadata"]["namespace"] = "team-a"
    return parse_manifest(example_manifest)


def test_the_policy_fences_in_exactly_the_jobs_pods(job):
    policy = trainer_network_policy(job, NetworkPolicySettings("kubetune-system", OPERATOR, egress=S3_ONLY), 9400)
    assert policy["metadata"]["namespace"] == "team-a" and policy["spec"]["policyTypes"] == ["Ingress", "Egress"]
    selector = policy["spec"]["podSelector"]["matchLabels"]
    master = PyTorchJobBackend().build(job, "uid", Settings())["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    assert selector.items() <= master["metadata"]["labels"].items()

    ingress, egress = policy["spec"]["ingress"], policy["spec"]["egress"]
    assert ingress[0] == {"from": [{"podSelector": {"matchLabels": selector}}]}, "rank to rank, any port"
    operator = ingress[1]
    assert operator["ports"] == [{"port": 9400, "protocol": "TCP"}]
    assert operator["from"][0]["namespaceSelector"] == {"matchLabels": {"kubernetes.io/metadata.name": "kubetune-system"}}
    assert egress[0] == {"to": [{"podSelector": {"matchLabels": selector}}]}
    assert {"port": 53, "protocol": "UDP"} in egress[1]["ports"] and "to" not in egress[1]
    assert egress[2:] == S3_ONLY, "nothing else: no API server, no other job's pods"


def test_metrics_sources_narrow_who_may_scrape(job):
    monitoring = [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]
    anyone = trainer_network_policy(job, NetworkPolicySettings("ns", OPERATOR), 9400)["spec"]["ingress"][2]
    assert anyone == {"ports": [{"port": 9400, "protocol": "TCP"}]}
    narrowed = trainer_network_policy(job, NetworkPolicySettings("ns", OPERATOR, metrics_from=monitoring), 9400)
    assert narrowed["spec"]["ingress"][2]["from"] == monitoring


def test_trainers_may_push_progress_to_the_operators_pods_on_the_inbox_port_only(job):
    pushing = NetworkPolicySettings("kubetune-system", OPERATOR, egress=S3_ONLY, progress_port=9401)
    egress = trainer_network_policy(job, pushing, 9400)["spec"]["egress"]
    operator = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "kubetune-system"}},
                "podSelector": {"matchLabels": OPERATOR}}
    assert egress[2] == {"to": [operator], "ports": [{"port": 9401, "protocol": "TCP"}]}
    assert egress[3:] == S3_ONLY
    assert NetworkPolicySettings.from_json('{"operatorNamespace": "o", "operatorLabels": {}, "progressPort": 9401}'
                                           ).progress_port == 9401


def test_settings_come_from_the_charts_json_and_a_malformed_one_names_the_helm_values():
    settings = Settings.from_env({"KUBETUNE_NETWORK_POLICY": '{"operatorNamespace": "ops", "operatorLabels": {"a": "b"}}'})
    assert settings.network_policy == NetworkPolicySettings("ops", {"a": "b"})
    assert Settings.from_env({}).network_policy is None
    with pytest.raises(ValueError, match=r"networkPolicy"):
        Settings.from_env({"KUBETUNE_NETWORK_POLICY": '{"operatorLabels": {}}'})
