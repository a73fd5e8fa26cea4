"""Upstream webhook configurations and CRD conversions, pointed at controllers on 127.0.0.1.

JobSet, Kubeflow Trainer and Kueue ship admission webhooks (defaulting and validation; Kueue's
mutating webhook is what suspends a queued job at creation) and Kueue converts its v1beta1 and
v1beta2 objects through a conversion webhook. In a cluster the API server reaches them through
a Service; here every controller is a host process and a Service cannot route to loopback
(Endpoints refuse 127.0.0.0/8). So the API server calls them by URL instead:
`clientConfig.url = https://127.0.0.1:<port><path>`, with the local CA as `caBundle` (the
controllers serve the certificate certs.py signs for 127.0.0.1). Everything else in the upstream
manifests is kept as shipped. Pure functions of the upstream YAML, so they are unit-tested.
"""
from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml

WEBHOOK_KINDS = ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration")


def ca_bundle(ca_crt: Path) -> str:
    return base64.b64encode(ca_crt.read_bytes()).decode()


def _url(port: int, path: str) -> str:
    return f"https://127.0.0.1:{port}{path}"


def _handles(webhook: dict, served: set[tuple[str, str]]) -> bool:
    """Whether one of WEBHOOK's rules names a (group, resource) in SERVED; ("group", "*") serves
    every resource of a group."""
    for rule in webhook.get("rules") or []:
        for group in rule.get("apiGroups") or []:
            for resource in rule.get("resources") or []:
                if (group, resource) in served or (group, "*") in served:
                    return True
    return False


def loopback_webhook_configurations(manifests: str, component: str, port: int, ca: str,
                                    served: set[tuple[str, str]] | None = None,
                                    object_selectors: dict[str, dict] | None = None) -> list[dict]:
    """The webhook configurations in MANIFESTS (upstream YAML), renamed `<component>-<name>` (as
    the upstream kustomize namePrefix does: JobSet, Trainer and Kueue all call theirs
    `mutating-webhook-configuration`) and calling https://127.0.0.1:PORT.

    SERVED, when given, keeps only the webhooks for those (group, resource) pairs: Kueue ships one
    for every integration it knows, most of them for workloads this control plane never runs,
    and each with failurePolicy Fail. OBJECT_SELECTORS sets a webhook's objectSelector by name,
    where upstream adds it with a kustomize patch that the module's manifests lack.
    """
    configurations = []
    for document in yaml.safe_load_all(manifests):
        if not document or document.get("kind") not in WEBHOOK_KINDS:
            continue
        configuration = copy.deepcopy(document)
        configuration["metadata"] = {"name": f"{component}-{document['metadata']['name']}",
                                     "labels": {"app.kubernetes.io/part-of": "kubetune-dev",
                                                "app.kubernetes.io/component": component}}
        webhooks = []
        for webhook in configuration.get("webhooks") or []:
            if served is not None and not _handles(webhook, served):
                continue
            path = webhook["clientConfig"]["service"]["path"]
            webhook["clientConfig"] = {"url": _url(port, path), "caBundle": ca}
            if object_selectors and webhook["name"] in object_selectors:
                webhook["objectSelector"] = object_selectors[webhook["name"]]
            webhooks.append(webhook)
        if webhooks:
            configuration["webhooks"] = webhooks
            configurations.append(configuration)
    return configurations


def conversion_crd_names(crd_kustomization: str, patches: dict[str, str]) -> set[str]:
    """The CRDs whose upstream kustomization turns on the conversion webhook: PATCHES maps a
    patch file name to its YAML; only the patches the kustomization lists (the others are
    commented out upstream) and that set `spec.conversion.strategy: Webhook` count."""
    listed = {entry["path"].rsplit("/", 1)[-1] for entry in yaml.safe_load(crd_kustomization).get("patches") or []
              if isinstance(entry, dict) and "path" in entry}
    names = set()
    for file_name in sorted(listed & set(patches)):
        patch = yaml.safe_load(patches[file_name])
        if ((patch.get("spec") or {}).get("conversion") or {}).get("strategy") == "Webhook":
            names.add(patch["metadata"]["name"])
    return names


def with_conversion_webhook(crd: dict, port: int, ca: str) -> dict:
    """CRD converting between its served versions through https://127.0.0.1:PORT/convert."""
    crd = copy.deepcopy(crd)
    crd["spec"]["conversion"] = {"strategy": "Webhook", "webhook": {
        "clientConfig": {"url": _url(port, "/convert"), "caBundle": ca},
        "conversionReviewVersions": ["v1"]}}
    return crd
