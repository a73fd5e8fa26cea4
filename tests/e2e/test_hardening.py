"""A hardened install on the local control plane (issue 16): the webhook's TLS and the per-job
NetworkPolicy.

The API server calls the webhook through the chart's Service (the kubelet's service proxy plays
kube-proxy), trusting the caBundle the operator publishes in the chart's
ValidatingWebhookConfiguration; the operator replaces its certificate before it expires without a
restart, and a restarted operator publishes a new one. Certificates live 60 s here, so a rotation
happens within the test. failurePolicy is Ignore, so an untrusted certificate would show as a bad
job being admitted: every check below applies one.

With networkPolicy.enabled the operator creates a NetworkPolicy beside each job, owned by it. This
control plane has no network plugin, so what is checked is the object (its selector matches the
job's pods) and its lifetime, not the enforcement."""
from __future__ import annotations

import base64
import socket
import ssl
import time

import pytest
import yaml
from cryptography import x509
from kubernetes import client

from tests.e2e.conftest import install_chart, uninstall_chart
from tests.e2e.jobs import OPERATOR_NAMESPACE, example_job, get_child, kubectl, operator_log
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e

LIFETIME_SECONDS = 60  # replaced after 40 s; the operator looks every 3 s
CONFIGURATION = "kubetune-trainingjobs"
SERVICE = "kubetune-webhook"


@pytest.fixture(scope="module")
def short_lived_certificates(control_plane):
    install_chart(control_plane, "pytorchjob", "--set", f"webhook.certificateLifetimeSeconds={LIFETIME_SECONDS}",
                  "--set", "networkPolicy.enabled=true")
    yield
    uninstall_chart(control_plane)


def trusted_serials(api_client) -> list[int]:
    """Serial numbers of the certificates in the configuration's caBundle (what the API server trusts)."""
    configuration = client.AdmissionregistrationV1Api(api_client).read_validating_webhook_configuration(CONFIGURATION)
    bundle = configuration.webhooks[0].client_config.ca_bundle
    return [c.serial_number for c in x509.load_pem_x509_certificates(base64.b64decode(bundle))] if bundle else []


def served_serial(core) -> int | None:
    """The serial number of the certificate the webhook presents at its Service's cluster IP, as
    the API server reaches it; None while nothing answers there."""
    service = core.read_namespaced_service(SERVICE, OPERATOR_NAMESPACE)
    context = ssl.create_default_context()
    context.check_hostname, context.verify_mode = False, ssl.CERT_NONE  # only reading what is served
    try:
        with socket.create_connection((service.spec.cluster_ip, service.spec.ports[0].port), timeout=5) as raw:
            with context.wrap_socket(raw) as tls:
                return x509.load_der_x509_certificate(tls.getpeercert(binary_form=True)).serial_number
    except OSError:
        return None


def webhook_refuses_disagreeing_queues(control_plane, namespace, inputs_in_s3) -> bool:
    """Whether the operator's admission webhook answers: it refuses a job queued two ways that disagree
    (the operator reads no Secret any more, so a missing one is no longer an admission refusal)."""
    manifest = example_job(inputs_in_s3, "two-queues", "runs/two-queues")
    manifest["metadata"].setdefault("labels", {})["kueue.x-k8s.io/queue-name"] = "one-queue"
    manifest["spec"]["scheduling"] = {"queueName": "another-queue"}
    result = kubectl(control_plane, "apply", "--dry-run=server", "-n", namespace, "-f", "-",
                     input=yaml.safe_dump(manifest), check=False)
    return result.returncode != 0 and "they are the same request" in result.stderr


def test_the_webhook_answers_through_its_service_across_certificate_rotations(
        control_plane, api_client, core, short_lived_certificates, job_namespace, inputs_in_s3):
    """Over a minute: it waits out a real rotation (a 60 s certificate, replaced after 40 s) and asks the webhook
    before and after."""
    first = eventually(lambda: (s := served_serial(core)) in trusted_serials(api_client) and s, timeout=60,
                       message=lambda: "the served certificate is never in the caBundle; operator log:\n"
                                       + operator_log(control_plane, core))
    assert webhook_refuses_disagreeing_queues(control_plane, job_namespace, inputs_in_s3)

    # Until the replacement is served, the webhook keeps answering; then the new one is trusted too.
    deadline = time.monotonic() + LIFETIME_SECONDS + 30
    while (served := served_serial(core)) == first and time.monotonic() < deadline:
        time.sleep(2)
    assert served not in (None, first), "the certificate was not replaced within its lifetime"
    trusted = trusted_serials(api_client)
    assert served in trusted and first in trusted, "the bundle trusts the new certificate and still the old one"
    assert webhook_refuses_disagreeing_queues(control_plane, job_namespace, inputs_in_s3), \
        "after the rotation the API server still reaches the webhook (a bad job would be admitted otherwise)"


def test_a_restarted_operator_publishes_its_own_certificate_and_no_job_is_lost(
        control_plane, api_client, core, short_lived_certificates, job_namespace, inputs_in_s3):
    kept = example_job(inputs_in_s3, "kept", "runs/kept")
    kept["spec"]["suspend"] = True  # reconcile only: no trainer pods for this test
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(kept))
    before = served_serial(core)
    kubectl(control_plane, "delete", "pod", "-n", OPERATOR_NAMESPACE, "-l", "app.kubernetes.io/name=kubetune-operator",
            "--wait=true")
    eventually(lambda: (s := served_serial(core)) not in (None, before) and s in trusted_serials(api_client),
               timeout=120, message=lambda: "the new operator's certificate is not served and trusted; operator log:\n"
                                            + operator_log(control_plane, core))
    assert webhook_refuses_disagreeing_queues(control_plane, job_namespace, inputs_in_s3)
    kubectl(control_plane, "get", "trainingjob", "kept", "-n", job_namespace)


def test_each_job_gets_a_network_policy_that_selects_its_pods_and_goes_with_it(
        control_plane, api_client, short_lived_certificates, job_namespace, inputs_in_s3):
    fenced = example_job(inputs_in_s3, "fenced", "runs/fenced")
    fenced["spec"]["suspend"] = True  # reconcile only: no trainer pods for this test
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(fenced))
    networking = client.NetworkingV1Api(api_client)
    policy = eventually(lambda: networking.list_namespaced_network_policy(job_namespace).items, timeout=60,
                        message="no NetworkPolicy for the job")[0]
    child = eventually(lambda: get_child(api_client, "pytorchjob", job_namespace, "fenced"), timeout=60)
    pod_labels = child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"]
    assert policy.spec.pod_selector.match_labels.items() <= pod_labels.items()
    assert policy.metadata.owner_references[0].kind == "TrainingJob"
    assert [r.ports[0].port for r in policy.spec.ingress if r.ports] == [9400, 9400], "only the metrics port from outside"

    kubectl(control_plane, "delete", "trainingjob", "fenced", "-n", job_namespace)
    eventually(lambda: not networking.list_namespaced_network_policy(job_namespace).items, timeout=60,
               message="the NetworkPolicy outlived its job")
