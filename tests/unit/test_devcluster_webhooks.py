"""The local control plane registers the controllers' upstream webhooks and conversions by URL on
127.0.0.1, and configures every controller to listen on loopback only."""
from __future__ import annotations

import pytest
import yaml

from kubetune_dev import controllers, webhooks

CA = "Q0EgYnVuZGxl"

UPSTREAM = """
apiVersion: admissionregistration.k8s.io/v1
kind: MutatingWebhookConfiguration
metadata:
  name: mutating-webhook-configuration
webhooks:
- name: mpytorchjob.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate-kubeflow-org-v1-pytorchjob}}
  failurePolicy: Fail
  rules: [{apiGroups: [kubeflow.org], apiVersions: [v1], operations: [CREATE], resources: [pytorchjobs]}]
  sideEffects: None
  admissionReviewVersions: [v1]
- name: mpod.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /mutate--v1-pod}}
  failurePolicy: Fail
  rules: [{apiGroups: [""], apiVersions: [v1], operations: [CREATE], resources: [pods]}]
  sideEffects: None
  admissionReviewVersions: [v1]
---
apiVersion: admissionregistration.k8s.io/v1
kind: ValidatingWebhookConfiguration
metadata:
  name: validating-webhook-configuration
webhooks:
- name: vclusterqueue.kb.io
  clientConfig: {service: {name: webhook-service, namespace: system, path: /validate-kueue-x-k8s-io-v1beta2-clusterqueue}}
  failurePolicy: Fail
  rules: [{apiGroups: [kueue.x-k8s.io], apiVersions: [v1beta2], operations: [CREATE, UPDATE], resources: [clusterqueues]}]
  sideEffects: None
  admissionReviewVersions: [v1]
---
apiVersion: v1
kind: Service
metadata: {name: webhook-service}
"""


def test_webhooks_are_called_by_url_on_loopback_with_the_local_ca():
    configurations = webhooks.loopback_webhook_configurations(UPSTREAM, "kueue", 9443, CA)
    assert [c["kind"] for c in configurations] == ["MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"]
    hooks = [h for c in configurations for h in c["webhooks"]]
    assert [h["clientConfig"] for h in hooks] == [
        {"url": "https://127.0.0.1:9443/mutate-kubeflow-org-v1-pytorchjob", "caBundle": CA},
        {"url": "https://127.0.0.1:9443/mutate--v1-pod", "caBundle": CA},
        {"url": "https://127.0.0.1:9443/validate-kueue-x-k8s-io-v1beta2-clusterqueue", "caBundle": CA}]
    # Everything else is kept as upstream ships it.
    assert {h["failurePolicy"] for h in hooks} == {"Fail"}
    assert hooks[0]["rules"] == [{"apiGroups": ["kubeflow.org"], "apiVersions": ["v1"], "operations": ["CREATE"],
                                  "resources": ["pytorchjobs"]}]


def test_each_component_gets_its_own_configuration_names():
    """JobSet, Trainer and Kueue all call theirs mutating-webhook-configuration upstream."""
    names = {c["metadata"]["name"] for component in ("jobset", "kueue")
             for c in webhooks.loopback_webhook_configurations(UPSTREAM, component, 1, CA)}
    assert names == {"jobset-mutating-webhook-configuration", "jobset-validating-webhook-configuration",
                     "kueue-mutating-webhook-configuration", "kueue-validating-webhook-configuration"}


def test_only_the_webhooks_of_served_resources_are_registered():
    configurations = webhooks.loopback_webhook_configurations(UPSTREAM, "kueue", 1, CA, served=controllers.KUEUE_SERVED)
    assert [h["name"] for c in configurations for h in c["webhooks"]] == ["mpytorchjob.kb.io", "vclusterqueue.kb.io"]
    # A configuration left without webhooks is not registered at all.
    only_pods = webhooks.loopback_webhook_configurations(UPSTREAM, "kueue", 1, CA, served={("", "pods")})
    assert [c["kind"] for c in only_pods] == ["MutatingWebhookConfiguration"]


def test_object_selectors_limit_a_webhook_to_its_own_objects():
    selector = {"matchExpressions": [{"key": "jobset.sigs.k8s.io/jobset-name", "operator": "Exists"}]}
    configurations = webhooks.loopback_webhook_configurations(UPSTREAM, "jobset", 1, CA,
                                                              object_selectors={"mpod.kb.io": selector})
    by_name = {h["name"]: h for c in configurations for h in c["webhooks"]}
    assert by_name["mpod.kb.io"]["objectSelector"] == selector
    assert "objectSelector" not in by_name["mpytorchjob.kb.io"]


def test_conversion_webhooks_follow_the_patches_the_upstream_kustomization_lists():
    kustomization = """
resources: [bases/kueue.x-k8s.io_workloads.yaml]
patches:
- path: patches/webhook_in_workloads.yaml
- path: patches/webhook_in_localqueues.yaml
#- path: patches/webhook_in_resourceflavors.yaml
"""
    def patch(name: str) -> str:
        return yaml.safe_dump({"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
                               "metadata": {"name": name}, "spec": {"conversion": {"strategy": "Webhook"}}})
    patches = {"webhook_in_workloads.yaml": patch("workloads.kueue.x-k8s.io"),
               "webhook_in_localqueues.yaml": patch("localqueues.kueue.x-k8s.io"),
               "webhook_in_resourceflavors.yaml": patch("resourceflavors.kueue.x-k8s.io")}
    assert webhooks.conversion_crd_names(kustomization, patches) == {"workloads.kueue.x-k8s.io",
                                                                     "localqueues.kueue.x-k8s.io"}


def test_a_converted_crd_calls_convert_on_loopback_and_is_otherwise_unchanged():
    crd = {"apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
           "metadata": {"name": "workloads.kueue.x-k8s.io"},
           "spec": {"group": "kueue.x-k8s.io", "versions": [{"name": "v1beta1"}, {"name": "v1beta2"}]}}
    converted = webhooks.with_conversion_webhook(crd, 9555, CA)
    assert converted["spec"]["conversion"] == {"strategy": "Webhook", "webhook": {
        "clientConfig": {"url": "https://127.0.0.1:9555/convert", "caBundle": CA},
        "conversionReviewVersions": ["v1"]}}
    assert converted["spec"]["versions"] == crd["spec"]["versions"]
    assert "conversion" not in crd["spec"], "the input is not modified"


@pytest.mark.parametrize("controller", controllers.CONTROLLERS, ids=lambda c: c.name)
def test_every_controller_listens_on_loopback_only_without_leader_election_or_its_own_certificates(controller):
    config = controller.configuration(9443, 8081, "/certs")
    assert config["webhook"]["host"] == "127.0.0.1" and config["webhook"]["port"] == 9443
    assert config["health"]["healthProbeBindAddress"] == "127.0.0.1:8081"
    assert config["metrics"]["bindAddress"] == "0", "metrics off: no listener on other interfaces"
    assert config["leaderElection"] == {"leaderElect": False}
    cert_management = config.get("internalCertManagement") or config.get("certManagement")
    assert cert_management == {"enable": False}


def test_kueue_runs_the_integrations_of_both_backends_the_priority_boost_and_no_visibility_server():
    kueue = next(c for c in controllers.CONTROLLERS if c.name == "kueue")
    config = kueue.configuration(1, 2, "/certs")
    assert config["integrations"]["frameworks"] == ["kubeflow.org/pytorchjob", "jobset.x-k8s.io/jobset",
                                                    "trainer.kubeflow.org/trainjob"]
    # Its aggregated visibility server would listen on a fixed port of every interface; the priority boost
    # (from a job's unsaved work, the chart's kueue.preemptionCost) is read only with its gate on.
    assert config["featureGates"] == {"VisibilityOnDemand": False, "PriorityBoost": True}
