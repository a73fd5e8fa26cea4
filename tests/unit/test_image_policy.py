"""The trainer-image allow-list (Helm value trainer.allowedImagePrefixes): which images match a
prefix, the message that names the field and the fix, and both places that enforce it (admission,
and reconcile, because the webhook fails open)."""
from __future__ import annotations

import dataclasses

import kopf
import pytest

from kubetune_operator import handlers, image_policy, kube
from kubetune_operator.settings import Settings
from tests.unit.test_operator_handlers import TRAINJOB_SETTINGS, api, job_body  # noqa: F401

PREFIXES = ("ghcr.io/team", "registry.example.com/ml/")


@pytest.mark.parametrize("image,ok", [
    ("ghcr.io/team/trainer:1.2", True),
    ("ghcr.io/team:1.2", True),                       # the repository itself, tagged
    ("ghcr.io/team@sha256:" + "0" * 64, True),
    ("ghcr.io/team-evil/trainer:1", False),           # a longer name is not under the prefix
    ("ghcr.io/teamtrainer:1", False),
    ("registry.example.com/ml/sd:3", True),           # a prefix ending in / is matched as written
    ("registry.example.com/mlx/sd:3", False),
    ("docker.io/library/python:3.11", False),
    ("evil.io/ghcr.io/team/trainer:1", False),        # only at the start
])
def test_an_image_matches_a_prefix_only_at_a_name_boundary(image, ok):
    assert image_policy.allowed(image, PREFIXES) is ok


def test_no_list_or_no_image_allows_everything_and_the_refusal_names_the_field_and_the_fix():
    default = "ghcr.io/kubetune/trainer:0.1.0"
    assert image_policy.refusal("anything:1", (), default) is None
    assert image_policy.refusal(None, PREFIXES, default) is None  # the operator's default image
    assert image_policy.refusal(default, PREFIXES, default) is None  # named explicitly: the chart chose it
    message = image_policy.refusal("docker.io/x/y:1", PREFIXES, default)
    assert message.startswith("spec.image: 'docker.io/x/y:1' is not from a registry this cluster allows")
    assert "ghcr.io/team, registry.example.com/ml/" in message and "trainer.allowedImagePrefixes" in message
    assert "leave spec.image unset" in message


def test_the_setting_is_read_from_the_environment_the_chart_renders():
    env = {"KUBETUNE_ALLOWED_IMAGE_PREFIXES": " ghcr.io/team , registry.example.com/ml/,"}
    assert Settings.from_env(env).allowed_image_prefixes == PREFIXES
    assert Settings.from_env({}).allowed_image_prefixes == ()


def test_the_webhook_refuses_an_image_off_the_list(api, example_manifest, monkeypatch):  # noqa: F811
    monkeypatch.setattr(kube, "settings", lambda: dataclasses.replace(TRAINJOB_SETTINGS, allowed_image_prefixes=PREFIXES))
    with pytest.raises(kopf.AdmissionError, match="spec.image: 'docker.io/x/y:1' is not from a registry"):
        handlers.validate_new_job(body=job_body(example_manifest, image="docker.io/x/y:1"), warnings=[])
    handlers.validate_new_job(body=job_body(example_manifest, image="ghcr.io/team/trainer:2"), warnings=[])

# The reconcile's refusal (the webhook fails open): tests/unit/test_decision.py, the image cases.
