"""What a TrainingJob's author may choose for the pods the operator creates for them: a
ServiceAccount only one they could use themselves (a ValidatingAdmissionPolicy, enforced by the
API server itself), and an image only from the chart's allowed registries (the webhook; reconcile
checks again, unit-tested in tests/unit/test_image_policy.py)."""
from __future__ import annotations

import pytest
import yaml

from tests.e2e.conftest import install_chart, uninstall_chart
from tests.e2e.jobs import example_job, kubectl
from tests.e2e.waiting import eventually

pytestmark = pytest.mark.e2e
IDENTITY = "trainer-identity"  # e.g. a ServiceAccount bound to a cloud IAM role with bucket access
ALLOWED = "localhost/kubetune/"  # the e2e trainer image is localhost/kubetune/trainer:dev (conftest.TRAINER_IMAGE)


@pytest.fixture(scope="module")
def release(control_plane):
    install_chart(control_plane, "pytorchjob", "--set", f"trainer.allowedImagePrefixes={{{ALLOWED}}}")
    yield
    uninstall_chart(control_plane)


@pytest.fixture
def team(control_plane, core, job_namespace):
    """JOB_NAMESPACE with the ServiceAccount, an author who may only create TrainingJobs (alice) and
    one who may also create pods (bob)."""
    core.create_namespaced_service_account(job_namespace, {"metadata": {"name": IDENTITY}})
    documents = [
        role("trainingjob-author", [{"apiGroups": ["kubetune.dev"], "resources": ["trainingjobs"],
                                     "verbs": ["create", "get", "patch"]}]),
        role("pod-creator", [{"apiGroups": [""], "resources": ["pods"], "verbs": ["create"]}]),
        binding("alice-authors", "trainingjob-author", "alice"), binding("bob-authors", "trainingjob-author", "bob"),
        binding("bob-creates-pods", "pod-creator", "bob"),
    ]
    kubectl(control_plane, "apply", "-n", job_namespace, "-f", "-", input=yaml.safe_dump_all(documents))
    return job_namespace


def role(name: str, rules: list[dict]) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": {"name": name}, "rules": rules}


def binding(name: str, role_name: str, user: str) -> dict:
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": {"name": name},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role_name},
            "subjects": [{"apiGroup": "rbac.authorization.k8s.io", "kind": "User", "name": user}]}


def apply_as(control_plane, user: str, namespace: str, manifest: dict):
    return kubectl(control_plane, "apply", "--dry-run=server", "--as", user, "-n", namespace, "-f", "-",
                   input=yaml.safe_dump(manifest), check=False)


def test_a_service_account_is_refused_to_an_author_who_could_not_use_it(control_plane, release, team, inputs_in_s3):
    plain = example_job(inputs_in_s3, "as-identity", "runs/as-identity")
    with_identity = example_job(inputs_in_s3, "as-identity", "runs/as-identity")
    with_identity["spec"]["scheduling"] = {"serviceAccountName": IDENTITY}

    refused = apply_as(control_plane, "alice", team, with_identity)
    assert refused.returncode != 0
    assert (f"spec.scheduling.serviceAccountName: alice may not use ServiceAccount {IDENTITY} in namespace {team}"
            in refused.stderr), refused.stderr
    assert "verb use on serviceaccounts/" + IDENTITY in refused.stderr
    # The same author without a ServiceAccount, and an author who may create pods (and so could run
    # a pod under any ServiceAccount of the namespace already), are admitted.
    assert apply_as(control_plane, "alice", team, plain).returncode == 0
    allowed = apply_as(control_plane, "bob", team, with_identity)
    assert allowed.returncode == 0, allowed.stderr
    # The narrowest grant: `use` on that one ServiceAccount.
    kubectl(control_plane, "apply", "-n", team, "-f", "-", input=yaml.safe_dump_all([
        role("use-identity", [{"apiGroups": [""], "resources": ["serviceaccounts"], "resourceNames": [IDENTITY],
                               "verbs": ["use"]}]),
        binding("alice-uses-identity", "use-identity", "alice")]))
    granted = eventually(lambda: (result := apply_as(control_plane, "alice", team, with_identity)).returncode == 0
                         and result, timeout=30, interval=1, message="alice admitted once granted `use`")
    assert "created (server dry run)" in granted.stdout


def test_an_image_outside_the_allowed_registries_is_refused_at_admission(control_plane, release, job_namespace,
                                                                          inputs_in_s3):
    manifest = example_job(inputs_in_s3, "foreign-image", "runs/foreign-image")
    manifest["spec"]["image"] = "docker.io/someone/trainer:latest"
    # The webhook's failurePolicy is Ignore: until kopf has registered it, a dry run is admitted.
    refused = eventually(lambda: (result := kubectl(
        control_plane, "apply", "--dry-run=server", "-n", job_namespace, "-f", "-", input=yaml.safe_dump(manifest),
        check=False)).returncode != 0 and result, timeout=120, interval=1, message="the webhook refusing the image")
    assert "spec.image: 'docker.io/someone/trainer:latest' is not from a registry this cluster allows" \
        in refused.stderr, refused.stderr
    manifest["spec"]["image"] = f"{ALLOWED}trainer:other-tag"
    admitted = kubectl(control_plane, "apply", "--dry-run=server", "-n", job_namespace, "-f", "-",
                       input=yaml.safe_dump(manifest), check=False)
    assert admitted.returncode == 0, admitted.stderr
