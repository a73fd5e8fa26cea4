"""The Helm chart: lint-clean, schema-guarded values, and manifests/install.yaml equal to its rendering."""
from __future__ import annotations

import subprocess

import pytest
import yaml

from tests.conftest import REPO

CHART = REPO / "charts" / "kubetune"


@pytest.fixture(scope="module")
def helm() -> str:
    from kubetune_dev import versions

    try:
        return str(versions.binary("helm"))
    except versions.MissingBinary as err:
        pytest.fail(f"helm is built by devcluster/build.sh (make cluster-bins): {err}")


def render(helm: str, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([helm, "template", "kubetune", str(CHART), "--namespace", "kubetune-system",
                           "--kube-version", "v1.34.4", *args], capture_output=True, text=True)


def test_chart_lints_cleanly(helm):
    result = subprocess.run([helm, "lint", str(CHART), "--strict", "--kube-version", "v1.34.4"],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_chart_renders_without_flags_as_gitops_tools_run_it_and_refuses_an_old_cluster(helm):
    offline = subprocess.run([helm, "template", "kubetune", str(CHART)], capture_output=True, text=True)
    assert offline.returncode == 0 and "kind: Deployment" in offline.stdout, offline.stderr
    old = render(helm, "--kube-version", "v1.29.9")
    assert old.returncode != 0 and "kubetune needs Kubernetes 1.30 or newer; this cluster runs v1.29.9" in old.stderr


def test_install_manifest_is_the_rendered_chart(helm):
    rendered = render(helm, "--include-crds", "--skip-tests")
    assert rendered.returncode == 0, rendered.stderr
    committed = (REPO / "manifests" / "install.yaml").read_text().split("\n", 1)[1]
    assert committed == rendered.stdout, "run `make manifests` and commit manifests/install.yaml"


def test_unknown_values_are_refused_by_the_schema(helm):
    result = render(helm, "--set", "operator.replicas=3")
    assert result.returncode != 0
    assert "replicas" in result.stderr and "additional properties" in result.stderr.lower()


def test_every_value_has_a_comment_above_it():
    lines = [line for line in (CHART / "values.yaml").read_text().splitlines() if line.strip()]
    for previous, line in zip(lines, lines[1:]):
        if not line.lstrip().startswith(("#", "- ")) and ":" in line:
            assert previous.lstrip().startswith("#"), f"no comment above {line.strip()!r} in values.yaml"


def test_operator_deployment_is_single_recreate_and_restricted(helm):
    documents = [d for d in yaml.safe_load_all(render(helm).stdout) if d]
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["replicas"] == 1 and deployment["spec"]["strategy"]["type"] == "Recreate"
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["securityContext"]["allowPrivilegeEscalation"] is False
    assert container["securityContext"]["capabilities"] == {"drop": ["ALL"]}
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True


def documents_of(result: subprocess.CompletedProcess) -> list[dict]:
    assert result.returncode == 0, result.stderr
    return [d for d in yaml.safe_load_all(result.stdout) if d]


def kinds(documents: list[dict]) -> set[str]:
    return {d["kind"] for d in documents}


def test_prometheus_operator_monitors_are_off_by_default(helm):
    assert not {"ServiceMonitor", "PodMonitor"} & kinds(documents_of(render(helm)))


def test_the_service_monitor_scrapes_the_operators_metrics_service(helm):
    documents = documents_of(render(helm, "--set", "metrics.serviceMonitor.enabled=true",
                                    "--set", "metrics.serviceMonitor.labels.release=kps",
                                    "--set", "metrics.serviceMonitor.interval=30s"))
    monitor = next(d for d in documents if d["kind"] == "ServiceMonitor")
    service = next(d for d in documents if d["kind"] == "Service")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": ["kubetune-system"]}
    port_names = {p["name"] for p in service["spec"]["ports"]}
    assert monitor["spec"]["endpoints"] == [{"port": "metrics", "path": "/metrics", "interval": "30s"}]
    assert "metrics" in port_names
    # Scraped through the ServiceMonitor, the pod is not annotated too (no double scrape).
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert "annotations" not in deployment["spec"]["template"]["metadata"]


def test_the_operator_pod_is_annotated_for_scraping_by_default(helm):
    deployment = next(d for d in documents_of(render(helm)) if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true", "prometheus.io/port": "9090", "prometheus.io/path": "/metrics"}
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "metrics", "containerPort": 9090, "protocol": "TCP"} in container["ports"]
    without = next(d for d in documents_of(render(helm, "--set", "metrics.annotations=false"))
                   if d["kind"] == "Deployment")
    assert "annotations" not in without["spec"]["template"]["metadata"]


@pytest.mark.parametrize("watch,selector", [
    ([], {"any": True}),
    (["team-a", "team-b"], {"matchNames": ["team-a", "team-b"]}),
])
def test_the_pod_monitor_selects_the_master_pods_the_operator_renders(helm, example_manifest, watch, selector):
    from kubetune_api.manifest import parse_manifest
    from kubetune_operator.backends import PyTorchJobBackend
    from kubetune_operator.settings import Settings

    args = ["--set", "backend=pytorchjob", "--set", "metrics.podMonitor.enabled=true",
            "--set", "metrics.podMonitor.labels.release=kps"]
    if watch:
        args += ["--set", "operator.watchNamespaces={" + ",".join(watch) + "}"]
    monitor = next(d for d in documents_of(render(helm, *args)) if d["kind"] == "PodMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["metadata"]["labels"]["release"] == "kps"
    assert monitor["spec"]["namespaceSelector"] == selector
    assert monitor["spec"]["podMetricsEndpoints"] == [{"port": "metrics", "path": "/metrics"}]

    # The labels the PodMonitor selects are on the pods: the operator's own on the template, and the
    # training operator's replica-type, which it sets to the lower-cased replica name.
    manifest = dict(example_manifest, metadata={"name": "sd15-lora", "namespace": "team-a"})
    master = PyTorchJobBackend().build(parse_manifest(manifest), "uid", Settings())["spec"]["pytorchReplicaSpecs"][
        "Master"]["template"]
    pod_labels = {**master["metadata"]["labels"], "training.kubeflow.org/replica-type": "master"}
    match = monitor["spec"]["selector"]
    assert match["matchLabels"].items() <= pod_labels.items()
    assert all(e["operator"] == "Exists" and e["key"] in pod_labels for e in match["matchExpressions"])
    assert "metrics" in {p["name"] for p in master["spec"]["containers"][0]["ports"]}


def test_the_dashboard_config_map_carries_the_dashboard_for_grafanas_sidecar(helm):
    import json

    config_map = next(d for d in documents_of(render(helm)) if d["kind"] == "ConfigMap")
    assert config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["namespace"] == "kubetune-system"
    dashboard = json.loads(config_map["data"]["kubetune.json"])
    assert dashboard == json.loads((CHART / "dashboards" / "kubetune.json").read_text())

    moved = documents_of(render(helm, "--set", "metrics.dashboard.namespace=monitoring",
                                "--set", "metrics.dashboard.labels.team=ml",
                                "--set", "metrics.dashboard.annotations.grafana_folder=Training"))
    config_map = next(d for d in moved if d["kind"] == "ConfigMap")
    assert config_map["metadata"]["namespace"] == "monitoring"
    assert config_map["metadata"]["labels"]["team"] == "ml" and config_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert config_map["metadata"]["annotations"] == {"grafana_folder": "Training"}
    off = documents_of(render(helm, "--set", "metrics.dashboard.enabled=false"))
    assert "ConfigMap" not in kinds(off)


@pytest.mark.parametrize("setting", ["metrics.podMonitor.interval=soon", "metrics.serviceMonitor.labels=x",
                                     "metrics.dashboard.namespace=Not_A_Namespace"])
def test_malformed_monitoring_values_are_refused(helm, setting):
    assert render(helm, "--set", setting).returncode != 0


def test_the_default_gpu_memory_reaches_the_operator_and_must_be_a_quantity(helm):
    documents = documents_of(render(helm, "--set", "trainer.gpuMemory=141Gi"))
    container = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "KUBETUNE_DEFAULT_GPU_MEMORY", "value": "141Gi"} in container["env"]
    refused = render(helm, "--set", "trainer.gpuMemory=80GB")
    assert refused.returncode != 0 and "gpuMemory" in refused.stderr


# ---- backends: which Kubeflow job runs a TrainingJob -------------------------------------------------

def rbac_rules(documents: list[dict]) -> dict[str, set[str]]:
    """{group/resource: verbs} of the operator's ClusterRole."""
    role = next(d for d in documents if d["kind"] == "ClusterRole")
    return {f"{group}/{resource}": set(rule["verbs"]) for rule in role["rules"]
            for group in rule["apiGroups"] for resource in rule["resources"]}


def operator_env(documents: list[dict]) -> dict[str, str]:
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    return {e["name"]: e.get("value") for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}


@pytest.mark.parametrize("settings,backends,pytorchjobs,trainjobs,runtime", [
    ([], "trainjob", False, True, True),
    (["--set", "backend=pytorchjob"], "pytorchjob", True, False, False),
    (["--set", "backend=pytorchjob", "--set", "trainjob.enabled=true"], "pytorchjob,trainjob", True, True, True),
    (["--set", "pytorchjob.enabled=true"], "pytorchjob,trainjob", True, True, True),
    (["--set", "backend=trainjob", "--set", "trainjob.runtime.create=false"], "trainjob", False, True, False),
], ids=["default-trainjob", "pytorchjob", "pytorchjob-plus-trainjob", "trainjob-plus-pytorchjob", "own-runtime"])
def test_rbac_and_the_runtime_follow_the_enabled_backends(helm, settings, backends, pytorchjobs, trainjobs, runtime):
    documents = documents_of(render(helm, *settings))
    rules = rbac_rules(documents)
    assert ("kubeflow.org/pytorchjobs" in rules) is pytorchjobs
    assert ("trainer.kubeflow.org/trainjobs" in rules) is trainjobs
    if trainjobs:
        assert rules["trainer.kubeflow.org/trainjobs"] == {"get", "list", "watch", "create", "patch", "delete"}
        assert rules["trainer.kubeflow.org/clustertrainingruntimes"] == {"get"}
        assert rules["trainer.kubeflow.org/trainjobs/status"] == {"patch"}
    assert not any(key.startswith("jobset.x-k8s.io") for key in rules), "JobSets are the Trainer's business"
    assert ("ClusterTrainingRuntime" in kinds(documents)) is runtime
    assert operator_env(documents)["KUBETUNE_BACKENDS"] == backends


def test_the_operator_may_create_and_read_generation_jobs_and_nothing_more_of_batch(helm):
    rules = rbac_rules(documents_of(render(helm)))
    assert {key: verbs for key, verbs in rules.items() if key.startswith("batch/")} == {"batch/jobs": {"get", "create"}}


def test_an_unknown_backend_is_refused_by_the_schema(helm):
    result = render(helm, "--set", "backend=mpijob")
    assert result.returncode != 0 and "backend" in result.stderr


def test_the_rendered_runtime_is_the_operators_runtime_with_the_chart_values(helm):
    from kubetune_operator.backends.trainjob import RuntimeValues, runtime

    documents = documents_of(render(helm, "--set", "backend=trainjob", "--set", "trainer.image=reg.example/t:9",
                                    "--set", "trainer.metricsPort=9555", "--set", "trainjob.runtime.name=kt-gpu",
                                    "--set", "trainjob.runtime.maxRestarts=5", "--set", "trainjob.reportProgress=false"))
    rendered = next(d for d in documents if d["kind"] == "ClusterTrainingRuntime")
    expected = runtime(RuntimeValues(name="kt-gpu", image="reg.example/t:9", metrics_port=9555, max_restarts=5))
    labels = rendered["metadata"].pop("labels")
    assert labels["trainer.kubeflow.org/framework"] == "torch" and labels["app.kubernetes.io/instance"] == "kubetune"
    expected["metadata"].pop("labels")
    assert rendered == expected
    env = operator_env(documents)
    assert (env["KUBETUNE_BACKEND"], env["KUBETUNE_TRAINJOB_RUNTIME"], env["KUBETUNE_TRAINJOB_MAX_RESTARTS"],
            env["KUBETUNE_TRAINJOB_REPORT_PROGRESS"]) == ("trainjob", "kt-gpu", "5", "false")
    assert "trainer.kubeflow.org/trainjobs/status" not in rbac_rules(documents)
    assert rbac_rules(documents)["trainer.kubeflow.org/clustertrainingruntimes"] == {"get"}


def test_one_pod_monitor_per_backend_selects_the_pod_its_backend_runs_rank_0_in(helm, example_manifest):
    from kubetune_api.manifest import parse_manifest
    from kubetune_operator.backends import BACKENDS
    from kubetune_operator.settings import Settings

    documents = documents_of(render(helm, "--set", "backend=trainjob", "--set", "pytorchjob.enabled=true",
                                    "--set", "metrics.podMonitor.enabled=true"))
    monitors = {d["metadata"]["name"]: d for d in documents if d["kind"] == "PodMonitor"}
    assert set(monitors) == {"kubetune-trainers", "kubetune-trainers-trainjob"}
    job = parse_manifest(dict(example_manifest, metadata={"name": "sd15-lora", "namespace": "team-a"}))
    for name, backend in (("kubetune-trainers", "pytorchjob"), ("kubetune-trainers-trainjob", "trainjob")):
        selector = monitors[name]["spec"]["selector"]
        # The labels of rank 0's pod: the operator's own, and what the backend's rank-0 selector names.
        rank0 = dict(pair.split("=") for pair in BACKENDS[backend].rank0_pod_selector("sd15-lora").split(","))
        child = BACKENDS[backend].build(job, "uid", Settings())
        own = (child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["metadata"]["labels"] if backend == "pytorchjob"
               else child["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0][
                   "template"]["spec"]["template"]["metadata"]["labels"])
        pod_labels = {**own, **rank0}
        assert selector["matchLabels"].items() <= pod_labels.items(), name
        assert all(e["key"] in pod_labels for e in selector["matchExpressions"]), name


def test_reading_kueues_workloads_is_granted_only_with_kueue_enabled(helm):
    default = documents_of(render(helm))
    assert not any(key.startswith("kueue.x-k8s.io") for key in rbac_rules(default))
    assert "KUBETUNE_KUEUE_WORKLOADS" not in operator_env(default)
    enabled = documents_of(render(helm, "--set", "kueue.enabled=true"))
    assert {k: v for k, v in rbac_rules(enabled).items() if k.startswith("kueue.x-k8s.io")} == {
        "kueue.x-k8s.io/workloads": {"list"}}, "read only, and only the Workloads"
    assert operator_env(enabled)["KUBETUNE_KUEUE_WORKLOADS"] == "true"
    assert "KUBETUNE_KUEUE_PREEMPTION_COST" not in operator_env(enabled)


def test_preemption_cost_adds_patching_workloads_and_its_settings(helm):
    from kubetune_operator.settings import Settings

    documents = documents_of(render(helm, "--set", "kueue.enabled=true", "--set", "kueue.preemptionCost=true",
                                    "--set", "kueue.maxPriorityBoost=9", "--set", "kueue.boostIntervalSeconds=30"))
    assert {k: v for k, v in rbac_rules(documents).items() if k.startswith("kueue.x-k8s.io")} == {
        "kueue.x-k8s.io/workloads": {"list", "patch"}}, "patch, and only the Workloads"
    env = operator_env(documents)
    settings = Settings.from_env(env).preemption_cost
    assert (settings.enabled, settings.max_boost, settings.interval_seconds, settings.seconds_per_point) == (
        True, 9, 30.0, 60.0)


def test_watched_namespaces_get_roles_and_the_cluster_role_keeps_only_what_is_cluster_scoped(helm):
    documents = documents_of(render(helm, "--set", "operator.watchNamespaces={team-a,team-b}",
                                    "--set", "pytorchjob.enabled=true", "--set", "kueue.enabled=true"))
    cluster_rules = rbac_rules(documents)
    assert set(cluster_rules) == {
        "/namespaces", "apiextensions.k8s.io/customresourcedefinitions",
        "admissionregistration.k8s.io/validatingwebhookconfigurations",
        "trainer.kubeflow.org/clustertrainingruntimes"}, "no Secret, pod or job anywhere else"
    roles = {d["metadata"]["namespace"]: d for d in documents if d["kind"] == "Role"}
    bindings = {d["metadata"]["namespace"]: d for d in documents if d["kind"] == "RoleBinding"}
    assert set(roles) == set(bindings) == {"team-a", "team-b"}
    for namespace, role in roles.items():
        rules = {f"{group}/{resource}": set(rule["verbs"]) for rule in role["rules"]
                 for group in rule["apiGroups"] for resource in rule["resources"]}
        assert "/secrets" not in rules and rules["kubetune.dev/trainingjobs"] == {"get", "list", "watch", "patch", "create"}
        assert rules["kubetune.dev/trainingsweeps"] == {"get", "list", "watch", "patch"}
        assert {"kubeflow.org/pytorchjobs", "trainer.kubeflow.org/trainjobs", "kueue.x-k8s.io/workloads"} <= set(rules)
        assert bindings[namespace]["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                                  "name": role["metadata"]["name"]}
        assert bindings[namespace]["subjects"][0]["kind"] == "ServiceAccount"
    # Cluster-wide (the default), the same namespaced rules sit in the ClusterRole and there is no Role.
    default = documents_of(render(helm))
    assert "/secrets" not in rbac_rules(default) and not [d for d in default if d["kind"] in ("Role", "RoleBinding")]


# ---- the admission webhook: owned by the chart, reached through its Service ---------------------

def cluster_role(documents: list[dict]) -> dict:
    return next(d for d in documents if d["kind"] == "ClusterRole")


def webhook_rules(documents: list[dict]) -> list[dict]:
    return [rule for rule in cluster_role(documents)["rules"] if "admissionregistration.k8s.io" in rule["apiGroups"]]


def one(documents: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in documents if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def test_the_operator_may_only_set_the_ca_bundle_of_the_charts_own_webhook_configuration(helm):
    documents = documents_of(render(helm))
    configuration = one(documents, "ValidatingWebhookConfiguration")
    name = configuration["metadata"]["name"]
    assert webhook_rules(documents) == [{
        "apiGroups": ["admissionregistration.k8s.io"], "resources": ["validatingwebhookconfigurations"],
        "resourceNames": [name], "verbs": ["get", "patch"]}], "no create (it cannot be narrowed by name), no mutating hooks"
    assert not [r for r in cluster_role(documents)["rules"] if "create" in r["verbs"] and
                {"validatingwebhookconfigurations", "mutatingwebhookconfigurations"} & set(r["resources"])]

    jobs, sweeps = configuration["webhooks"]
    # kopf serves each admission handler under its id: handlers.validate_new_job, sweeps.validate_new_sweep.
    for hook, resource, path in ((jobs, "trainingjobs", "/validate"), (sweeps, "trainingsweeps", "/validate-sweep")):
        assert hook["failurePolicy"] == "Ignore" and hook["sideEffects"] == "None" and "caBundle" not in hook["clientConfig"]
        assert hook["rules"][0]["operations"] == ["CREATE"] and hook["rules"][0]["resources"] == [resource]
        assert "url" not in hook["clientConfig"], "reached through its Service, not a pod address"
        assert hook["clientConfig"]["service"]["path"] == path
    service_ref = jobs["clientConfig"]["service"]
    assert sweeps["clientConfig"]["service"]["name"] == service_ref["name"]
    service = one(documents, "Service", service_ref["name"])
    deployment = one(documents, "Deployment")
    assert service_ref["namespace"] == service["metadata"]["namespace"] == "kubetune-system"
    assert service_ref["port"] == service["spec"]["ports"][0]["port"] == 443
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "webhook", "containerPort": 9443, "protocol": "TCP"} in container["ports"]

    env = operator_env(documents)
    assert env["KUBETUNE_WEBHOOK_CERTIFICATES"] == "operator" and env["KUBETUNE_WEBHOOK_CONFIGURATION"] == name
    assert f"{service_ref['name']}.kubetune-system.svc" in env["KUBETUNE_WEBHOOK_DNS_NAMES"].split(","), \
        "the certificate must carry the name the API server calls"
    assert "KUBETUNE_WEBHOOK_CERT_DIR" not in env


def test_with_cert_manager_the_certificate_is_mounted_and_injected_and_the_operator_touches_no_configuration(helm):
    documents = documents_of(render(helm, "--set", "webhook.certificates=cert-manager"))
    assert webhook_rules(documents) == []
    configuration = one(documents, "ValidatingWebhookConfiguration")
    service_name = configuration["webhooks"][0]["clientConfig"]["service"]["name"]
    serving = next(d for d in documents if d["kind"] == "Certificate" and not d["spec"].get("isCA"))
    assert configuration["metadata"]["annotations"]["cert-manager.io/inject-ca-from"] == \
        f"kubetune-system/{serving['metadata']['name']}"
    assert f"{service_name}.kubetune-system.svc" in serving["spec"]["dnsNames"]
    # Its own CA: renewing the serving certificate keeps the injected caBundle.
    ca = one(documents, "Certificate", serving["spec"]["issuerRef"]["name"])
    assert ca["spec"]["isCA"] and one(documents, "Issuer", serving["spec"]["issuerRef"]["name"])["spec"]["ca"] == {
        "secretName": ca["spec"]["secretName"]}
    deployment = one(documents, "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "webhook-tls")
    assert volume["secret"]["secretName"] == serving["spec"]["secretName"]
    # Readable by the non-root operator: group-owned by its fsGroup, group-readable, no one else.
    assert volume["secret"]["defaultMode"] == 0o440
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    env = operator_env(documents)
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "webhook-tls")
    assert env["KUBETUNE_WEBHOOK_CERTIFICATES"] == "files" and env["KUBETUNE_WEBHOOK_CERT_DIR"] == mount["mountPath"]
    assert mount["readOnly"]

    own_issuer = documents_of(render(helm, "--set", "webhook.certificates=cert-manager", "--set",
                                     "webhook.certManager.issuerRef.name=corp-ca", "--set",
                                     "webhook.certManager.issuerRef.kind=ClusterIssuer"))
    assert not [d for d in own_issuer if d["kind"] == "Issuer"]
    assert one(own_issuer, "Certificate")["spec"]["issuerRef"] == {"name": "corp-ca", "kind": "ClusterIssuer",
                                                                  "group": "cert-manager.io"}


def test_the_webhook_covers_only_the_watched_namespaces(helm):
    documents = documents_of(render(helm, "--set", "operator.watchNamespaces={team-a,team-b}"))
    hook = one(documents, "ValidatingWebhookConfiguration")["webhooks"][0]
    assert hook["namespaceSelector"] == {"matchExpressions": [
        {"key": "kubernetes.io/metadata.name", "operator": "In", "values": ["team-a", "team-b"]}]}


@pytest.mark.parametrize("setting", ["webhook.certificates=letsencrypt", "webhook.timeoutSeconds=60",
                                     "webhook.certManager.duration=90d"])
def test_malformed_webhook_values_are_refused(helm, setting):
    result = render(helm, "--set", setting)
    assert result.returncode != 0 and setting.split("=")[0].rsplit(".", 1)[-1] in result.stderr


def test_the_trainers_default_requests_and_cache_limit_reach_the_operator_and_must_be_quantities(helm):
    env = operator_env(documents_of(render(helm)))
    assert (env["KUBETUNE_DEFAULT_CPU_PER_PROCESS"], env["KUBETUNE_DEFAULT_MEMORY_PER_PROCESS"],
            env["KUBETUNE_CACHE_SIZE_LIMIT"]) == ("2", "8Gi", "200Gi")
    off = operator_env(documents_of(render(helm, "--set", "trainer.defaultRequests.memoryPerProcess=")))
    assert off["KUBETUNE_DEFAULT_MEMORY_PER_PROCESS"] == ""
    for setting in ("trainer.defaultRequests.cpuPerProcess=two", "trainer.cacheSizeLimit=lots"):
        result = render(helm, "--set", setting)
        assert result.returncode != 0 and setting.split("=")[0].rsplit(".", 1)[-1] in result.stderr, result.stderr


def test_network_policies_are_optional_and_the_operator_gets_what_it_needs_to_create_them(helm):
    from kubetune_operator.network_policy import NetworkPolicySettings

    default = documents_of(render(helm))
    assert "NetworkPolicy" not in kinds(default) and "networking.k8s.io/networkpolicies" not in rbac_rules(default)
    assert "KUBETUNE_NETWORK_POLICY" not in operator_env(default)

    documents = documents_of(render(helm, "--set", "networkPolicy.enabled=true"))
    assert rbac_rules(documents)["networking.k8s.io/networkpolicies"] == {"get", "create"}
    policy = one(documents, "NetworkPolicy", "kubetune")
    deployment = one(documents, "Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert policy["spec"]["podSelector"]["matchLabels"].items() <= pod_labels.items()
    assert {"ports": [{"port": 9443, "protocol": "TCP"}]} in policy["spec"]["ingress"], "the API server calls the webhook"
    settings = NetworkPolicySettings.from_json(operator_env(documents)["KUBETUNE_NETWORK_POLICY"])
    assert settings.operator_namespace == "kubetune-system"
    assert settings.operator_labels.items() <= pod_labels.items(), "the trainers' policies let the operator in"
    assert settings.egress == [{"ports": [{"port": 443, "protocol": "TCP"}, {"port": 80, "protocol": "TCP"}]}]



def test_trainers_push_progress_to_the_operators_progress_service_and_policies_let_them(helm):
    from kubetune_operator.network_policy import NetworkPolicySettings
    from kubetune_operator.settings import Settings

    documents = documents_of(render(helm, "--set", "networkPolicy.enabled=true"))
    service = one(documents, "Service", "kubetune-progress")
    assert service["spec"]["ports"] == [{"name": "progress", "port": 9401, "targetPort": "progress", "protocol": "TCP"}]
    container = one(documents, "Deployment")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "progress", "containerPort": 9401, "protocol": "TCP"} in container["ports"]
    settings = Settings.from_env({k: v for k, v in operator_env(documents).items() if v is not None})
    assert settings.progress_url == "http://kubetune-progress.kubetune-system.svc:9401"
    assert (settings.progress_inbox_address, settings.progress_inbox_port) == ("$(POD_IP)", 9401)
    assert NetworkPolicySettings.from_json(operator_env(documents)["KUBETUNE_NETWORK_POLICY"]).progress_port == 9401
    ingress = one(documents, "NetworkPolicy", "kubetune")["spec"]["ingress"]
    assert any(rule["ports"] == [{"port": 9401, "protocol": "TCP"}] and "from" in rule for rule in ingress)

    off = documents_of(render(helm, "--set", "networkPolicy.enabled=true", "--set", "operator.progressPush.enabled=false"))
    assert not {"KUBETUNE_PROGRESS_URL", "KUBETUNE_PROGRESS_INBOX_ADDRESS"} & operator_env(off).keys()
    assert NetworkPolicySettings.from_json(operator_env(off)["KUBETUNE_NETWORK_POLICY"]).progress_port is None
    assert not [d for d in off if d["metadata"]["name"] == "kubetune-progress"]


# Every right the operator may hold, with every option on: a rule outside this list fails the test,
# so a new right is a decision written down here (templates/rbac.yaml says why for each).
RBAC_ALLOW_LIST = {
    # create: a TrainingSweep's trials; never delete (the garbage collector removes them with their sweep).
    ("kubetune.dev", "trainingjobs"): {"get", "list", "watch", "patch", "create"},
    ("kubetune.dev", "trainingjobs/status"): {"get", "patch"},
    ("kubetune.dev", "trainingsweeps"): {"get", "list", "watch", "patch"},
    ("kubetune.dev", "trainingsweeps/status"): {"get", "patch"},
    ("kubeflow.org", "pytorchjobs"): {"get", "list", "watch", "create", "patch"},
    ("trainer.kubeflow.org", "trainjobs"): {"get", "list", "watch", "create", "patch", "delete"},
    ("trainer.kubeflow.org", "trainjobs/status"): {"patch"},
    ("trainer.kubeflow.org", "clustertrainingruntimes"): {"get"},
    # patch: Kueue's priority boost annotation (kueue.preemptionCost), nothing else of a Workload.
    ("kueue.x-k8s.io", "workloads"): {"list", "patch"},
    ("networking.k8s.io", "networkpolicies"): {"get", "create"},
    # `kubetune generate --on-cluster`: created per request, polled; removed by the garbage collector.
    ("batch", "jobs"): {"get", "create"},
    ("", "configmaps"): {"get", "create", "patch"},
    ("", "pods"): {"list"},
    ("", "events"): {"create", "patch"},
    ("events.k8s.io", "events"): {"create", "patch"},
    ("", "namespaces"): {"list", "watch"},
    ("apiextensions.k8s.io", "customresourcedefinitions"): {"list", "watch"},
    ("admissionregistration.k8s.io", "validatingwebhookconfigurations"): {"get", "patch"},
}
# Rules that must name their objects (RBAC's resourceNames): never every object of the kind.
NAMED_ONLY = {("trainer.kubeflow.org", "clustertrainingruntimes"),
              ("admissionregistration.k8s.io", "validatingwebhookconfigurations")}


@pytest.mark.parametrize("mode", [[], ["--set", "operator.watchNamespaces={team-a,team-b}"]],
                         ids=["all-namespaces", "watched-namespaces"])
def test_every_rbac_rule_is_on_the_allow_list(helm, mode):
    everything_on = ["--set", "trainjob.enabled=true", "--set", "kueue.enabled=true", "--set", "kueue.preemptionCost=true",
                     "--set", "networkPolicy.enabled=true"]
    documents = documents_of(render(helm, *everything_on, *mode))
    roles = [d for d in documents if d["kind"] in ("ClusterRole", "Role")]
    assert roles
    for role in roles:
        for rule in role["rules"]:
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    key = (group, resource)
                    assert key in RBAC_ALLOW_LIST, f"{role['kind']} grants {rule['verbs']} on {group}/{resource}"
                    assert set(rule["verbs"]) <= RBAC_ALLOW_LIST[key], f"{role['kind']}: {group}/{resource} {rule['verbs']}"
                    assert "*" not in rule["verbs"] and "*" not in rule["resources"]
                    if key in NAMED_ONLY:
                        assert rule.get("resourceNames"), f"{group}/{resource} must be limited by name"
    assert not any("secrets" in rule["resources"] for role in roles for rule in role["rules"]), \
        "the operator reads no Secret: the pods report a missing one"
