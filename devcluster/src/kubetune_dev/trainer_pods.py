"""The trainer pods the operator creates for an example TrainingJob, as `kind: Pod` documents.

`make lint` (kubetune_dev.lint) lints these with kube-score and checkov. Neither linter
knows the Kubeflow kinds (PyTorchJob, TrainJob, ClusterTrainingRuntime): they skip them, so a
trainer pod would go unchecked. What the Kubeflow controllers finally create from them is a Pod
built from the pod template the operator renders, so each template is printed here as that Pod.

  * PyTorchJob backend: the Master's and the Worker's pod templates, exactly as
    backends.pytorchjob builds them.
  * TrainJob backend: the ClusterTrainingRuntime's pod (what the chart ships, backends.trainjob.runtime)
    with the TrainJob's overrides applied the way Kubeflow Trainer applies them: spec.trainer's
    image, args, env and resourcesPerNode on the `node` container, and the runtime patch's pod
    metadata, volumes (merged by name) and scheduling fields. This is a model of Trainer's merge,
    enough for linting: the fields a linter reads (security context, resources, probes, volumes,
    token) come from the operator either way.

Each job is rendered twice: as manifests/examples/sd15-lora.yaml says (one node), and with two
nodes and the embedding cache on, so that Workers and the cache stage are linted too.
Usage: python -m kubetune_dev.trainer_pods [MANIFEST] > pods.yaml
"""
from __future__ import annotations

import copy
import functools
import sys
from pathlib import Path

import yaml

from kubetune_api.families import EMBEDDING_CACHE, FAMILIES
from kubetune_api.manifest import apply_overrides, load_manifest, parse_manifest
from kubetune_operator.backends import PyTorchJobBackend, TrainJobBackend
from kubetune_operator.backends.trainjob import NODE, RuntimeValues, runtime
from kubetune_operator.network_policy import NetworkPolicySettings, trainer_network_policy
from kubetune_operator.settings import Settings

REPO = Path(__file__).resolve().parents[3]
EXAMPLES = REPO / "manifests" / "examples"
EXAMPLE = EXAMPLES / "sd15-lora.yaml"
NAMESPACE = "team-a"
UID = "00000000-0000-4000-8000-000000000000"  # any UID: it only names the run and the rendezvous port
CHART_VALUES = REPO / "charts" / "kubetune" / "values.yaml"


@functools.cache
def chart_values() -> dict:
    """The chart's default values, read once (every example's pods are rendered from them)."""
    return yaml.safe_load(CHART_VALUES.read_text())


def chart_default_settings() -> Settings:
    """The operator as the chart's defaults configure it (values.yaml: the default requests and the
    cache size limit), with both backends allowed."""
    trainer = chart_values()["trainer"]
    return Settings(backends=("pytorchjob", "trainjob"),
                    default_cpu_per_process=trainer["defaultRequests"]["cpuPerProcess"],
                    default_memory_per_process=trainer["defaultRequests"]["memoryPerProcess"],
                    cache_size_limit=trainer["cacheSizeLimit"])


SETTINGS = chart_default_settings()


def as_pod(name: str, template: dict) -> dict:
    """A pod template (metadata + spec) as the Pod a controller creates from it."""
    metadata = {**copy.deepcopy(template.get("metadata") or {}), "name": name, "namespace": NAMESPACE}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": copy.deepcopy(template["spec"])}


def pytorchjob_pods(job, suffix: str) -> list[dict]:
    replicas = PyTorchJobBackend().build(job, UID, SETTINGS)["spec"]["pytorchReplicaSpecs"]
    return [as_pod(f"{job.metadata.name}{suffix}-pytorchjob-{role.lower()}", spec["template"])
            for role, spec in replicas.items()]


def merge_by_name(base: list[dict], patch: list[dict]) -> list[dict]:
    """A strategic merge of a list keyed by name: patched entries replace, new ones are appended."""
    patched = {item["name"]: item for item in patch}
    merged = [patched.pop(item["name"], item) for item in base]
    return merged + list(patched.values())


def trainjob_pod(job, suffix: str) -> dict:
    train_job = TrainJobBackend().build(job, UID, SETTINGS)
    pod = copy.deepcopy(runtime(RuntimeValues(image=SETTINGS.trainer_image,
                                              metrics_port=SETTINGS.trainer_metrics_port))
                        ["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"])
    # spec.trainer: image, entry-point arguments, environment and resources of the `node` container.
    trainer = train_job["spec"]["trainer"]
    container = next(c for c in pod["spec"]["containers"] if c["name"] == NODE)
    container["image"] = trainer["image"]
    container["env"] = trainer["env"]
    if "args" in trainer:
        container["args"] = trainer["args"]
    if "resourcesPerNode" in trainer:
        container["resources"] = trainer["resourcesPerNode"]
    # spec.runtimePatches: pod metadata, volumes (by name) and scheduling fields.
    patch = train_job["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"][0]
    patch_pod = patch["template"]["spec"]["template"]
    pod["metadata"] = {**pod.get("metadata", {}), **patch_pod["metadata"]}
    for key, value in patch_pod["spec"].items():
        if key == "volumes":
            pod["spec"][key] = merge_by_name(pod["spec"].get(key, []), value)
        elif key == "containers":  # a container patch's mounts are upserted by mountPath
            for patch_container in value:
                target = next(c for c in pod["spec"]["containers"] if c["name"] == patch_container["name"])
                paths = {m["mountPath"] for m in patch_container.get("volumeMounts", [])}
                target["volumeMounts"] = [m for m in target.get("volumeMounts", []) if m["mountPath"] not in paths] \
                    + patch_container.get("volumeMounts", [])
        else:
            pod["spec"][key] = value
    return as_pod(f"{job.metadata.name}{suffix}-trainjob-node", pod)


def network_policy(job) -> dict:
    """The NetworkPolicy the operator creates beside the job with networkPolicy.enabled (the chart's
    default rules for it), so the linters see the trainer pods fenced in as a hardened install has them."""
    chart = chart_values()
    policy = NetworkPolicySettings(operator_namespace="kubetune-system",
                                   operator_labels={"app.kubernetes.io/name": "kubetune-operator"},
                                   metrics_from=chart["networkPolicy"]["metricsFrom"],
                                   egress=chart["networkPolicy"]["trainerEgress"])
    return trainer_network_policy(job, policy, SETTINGS.trainer_metrics_port)


def trainer_pods(path: Path = EXAMPLE) -> list[dict]:
    """Every trainer pod both backends create for the job in PATH, one node and two, and the
    NetworkPolicy that selects them (both variants carry the same job labels)."""
    job = load_manifest(path, [f"metadata.namespace={NAMESPACE}"])
    manifest = job.model_dump(by_alias=True, exclude_none=True, mode="json")
    # Two nodes, with the embedding cache on where the family has one (it adds the cache volume).
    cache = ["spec.data.cache.enabled=true"] if EMBEDDING_CACHE in FAMILIES[job.spec.model.family].honours else []
    multi_node = parse_manifest(apply_overrides(manifest, ["spec.resources.nodes=2", *cache]))
    pods = []
    for variant, suffix in ((job, ""), (multi_node, "-2nodes")):
        pods += pytorchjob_pods(variant, suffix)
        pods.append(trainjob_pod(variant, suffix))
    return pods + [network_policy(job)]


def every_examples_trainer_pods() -> list[dict]:
    """trainer_pods() for each example in manifests/examples (each job has its own name)."""
    return [document for path in sorted(EXAMPLES.glob("*.yaml")) for document in trainer_pods(path)]


def main(argv: list[str]) -> None:
    path = Path(argv[0]) if argv else EXAMPLE
    print(f"# Trainer pods for {path}, rendered by kubetune_dev.trainer_pods.")
    sys.stdout.write(yaml.safe_dump_all(trainer_pods(path), sort_keys=False, width=120))


if __name__ == "__main__":
    main(sys.argv[1:])
