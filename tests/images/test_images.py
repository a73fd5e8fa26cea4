"""Our two images, built by `make images`' own module, and the trainer image run as a real container
(podman, runc) under the securityContext, volumes and command the operator renders for its pods.

STAND-IN: the images' base, python:3.11-slim-bookworm, cannot be pulled on this machine (no image
registry is reachable), so `make images` builds a local stand-in of it from Debian bookworm's own
packages (devcluster/standin-base.sh); the first test prints which base the images were built on."""
import json
import os
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from kubetune_api.manifest import parse_manifest
from kubetune_dev import container_runtime, image_build, processes
from kubetune_dev.kubelet import RECORD, remove_orphaned_containers
from kubetune_dev.podrunner import POD_DIR_LABEL
from kubetune_dev.podenv import declared_env
from kubetune_operator.backends import PyTorchJobBackend
from kubetune_operator.pod_template import NON_ROOT_UID
from kubetune_operator.settings import Settings
from kubetune_operator.trainer_config import build_config_map
from tests.trainer.conftest import family_job


def inspect(image: str) -> dict:
    found = image_build.inspect(image)
    assert found is not None, f"{image} is not in podman's store"
    return found


def dockerfile_entrypoint(dockerfile: Path) -> list[str]:
    line = next(line for line in dockerfile.read_text().splitlines() if line.startswith("ENTRYPOINT "))
    return json.loads(line.removeprefix("ENTRYPOINT "))


def test_each_image_holds_this_checkout_runs_as_the_pods_user_and_names_its_base(built_images):
    for name, image in built_images.items():
        dockerfile = image_build.REPO / image_build.DOCKERFILES[name]
        found = inspect(image)
        base = image_build.base_image(dockerfile)
        base_id = inspect(base)["Id"]
        assert found["Labels"][image_build.SOURCE_LABEL] == image_build.source_digest(dockerfile, base_id), \
            f"{image} was not built from this checkout's files"
        assert found["Config"]["User"] == f"{NON_ROOT_UID}:{NON_ROOT_UID}"
        assert found["Config"]["Entrypoint"] == dockerfile_entrypoint(dockerfile)
        standin = bool(inspect(base)["Labels"].get(image_build.STANDIN_LABEL))
        assert found["Labels"][image_build.BASE_LABEL] == ("stand-in " if standin else "") + base
        print(f"{image}: {found['Size'] / 1e9:.2f} GB on {'a LOCAL STAND-IN of ' if standin else ''}{base}")


def test_a_trainer_image_missing_a_library_or_with_files_only_root_can_read_fails_its_build_naming_them(
        built_images, tmp_path):
    """The image check the trainer's Dockerfile runs as UID 10001 (kubetune_trainer.image_check) fails the
    build of an image that lacks one of the trainer's libraries (ftfy), has an installed file only root can
    read and a package folder only root can enter. (A build's RUN keeps its capabilities even as UID 10001,
    so the last two still import there: the check asks the kernel with access(2), which ignores them, as
    a pod with every capability dropped would find.)"""
    image = built_images["trainer"]
    where = subprocess.run([*container_runtime.run_command(), "--network", "none", "--entrypoint", "python", image,
                            "-c",
                            "import importlib.util as u; print(u.find_spec('diffusers').origin, "
                            "*(u.find_spec(name).submodule_search_locations[0] for name in ('peft', 'ftfy')))"],
                           capture_output=True, text=True, check=True).stdout.split()
    unreadable_file, closed_folder, library = where
    (tmp_path / "Dockerfile").write_text(
        f"FROM {image}\nUSER 0:0\nRUN chmod 600 {unreadable_file} && chmod 700 {closed_folder} && rm -r {library}\n"
        f"USER {NON_ROOT_UID}\nRUN python -m kubetune_trainer.image_check\n")
    # --layers=false: a failed build leaves no intermediate images behind.
    result = subprocess.run(["podman", "build", "--pull=never", "--layers=false", "--network", "none",
                             *image_build.ulimit_flags(),
                             "--tag", "localhost/kubetune/broken-trainer:test", str(tmp_path)],
                            capture_output=True, text=True, timeout=600)
    subprocess.run(["podman", "rmi", "--force", "localhost/kubetune/broken-trainer:test"], capture_output=True)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output[-3000:]
    assert "import ftfy: ModuleNotFoundError: No module named 'ftfy'" in output, output[-3000:]
    unreadable = next(line for line in output.splitlines() if "unreadable by UID" in line)
    assert f"2 installed files unreadable by UID {NON_ROOT_UID}" in unreadable, unreadable
    assert unreadable_file in unreadable and f"{closed_folder}/" in unreadable, unreadable
    assert f"FAILED as UID {NON_ROOT_UID}: the image cannot train" in output


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def rendered_pod(built_images, tiny_model, tiny_dataset, tmp_path_factory):
    """The operator's pod for a two-step SD1.5 job whose model and data sit on read-only claims and whose
    checkpoints go to a third, and the host directories standing in for those claims and the ConfigMap."""
    root = tmp_path_factory.mktemp("container-pod")
    # Claims as fsGroup leaves them: the pod's group owns every file, so only a read-only mount keeps the
    # model and the data from being written.
    claims = {"model": root / "model", "data": root / "data", "checkpoints": root / "checkpoints"}
    shutil.copytree(tiny_model("sd15"), claims["model"])
    shutil.copytree(tiny_dataset("captions"), claims["data"])
    claims["checkpoints"].mkdir()
    for claim in claims.values():
        for path in [claim, *claim.rglob("*")]:
            os.chown(path, NON_ROOT_UID, NON_ROOT_UID)
    manifest = family_job("sd15", "captions", Path("/model"), Path("/data"), Path("/checkpoints"),
                          checkpoints={"everySteps": 1})
    manifest["spec"]["volumes"] = [
        {"name": "model", "mountPath": "/model", "readOnly": True, "persistentVolumeClaim": {"claimName": "model"}},
        {"name": "data", "mountPath": "/data", "readOnly": True, "persistentVolumeClaim": {"claimName": "data"}},
        {"name": "checkpoints", "mountPath": "/checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}},
    ]
    job = parse_manifest(manifest)
    child = PyTorchJobBackend().build(job, "uid-container", Settings(trainer_image=built_images["trainer"]))
    template = child["spec"]["pytorchReplicaSpecs"]["Master"]["template"]
    config = root / "config"
    config.mkdir()
    for key, text in build_config_map(job)["data"].items():
        (config / key).write_text(text)
    return template["spec"], {**claims, "config": config}, root


def run_container(pod_spec: dict, sources: dict, pod_dir: Path, name: str, command: list[str] | None = None,
                  timeout: float = 600) -> subprocess.CompletedProcess:
    container = dict(pod_spec["containers"][0])
    if command:
        container["command"], container["args"] = command, []
    # Stand-in for what the Kubeflow training operator injects into a one-node PyTorchJob's pod.
    container["env"] = container["env"] + [
        {"name": "PET_NNODES", "value": "1"}, {"name": "PET_NODE_RANK", "value": "0"},
        {"name": "PET_NPROC_PER_NODE", "value": "1"}, {"name": "MASTER_ADDR", "value": "127.0.0.1"},
        {"name": "MASTER_PORT", "value": str(free_port())}, {"name": "OMP_NUM_THREADS", "value": "1"}]
    pod = {"metadata": {"name": name, "namespace": "default"}, "spec": pod_spec, "status": {"podIP": "127.0.0.1"}}
    env = declared_env(None, pod, container, {})
    argv = container_runtime.podman_run(pod_spec, container, env, name, pod_dir, sources)
    try:
        return subprocess.run(argv, capture_output=True, text=True, timeout=timeout,
                              cwd=container_runtime.runtime_dir(pod_dir, name))
    finally:
        subprocess.run(["podman", "rm", "--force", "--ignore", name], capture_output=True)


PROBE = """
import json, os
def writes(path):
    try:
        with open(os.path.join(path, ".probe"), "w"):
            pass
        os.remove(os.path.join(path, ".probe"))
        return "ok"
    except OSError as error:
        return error.strerror
status = dict(line.split(":\\t", 1) for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
print(json.dumps({"uid": os.getuid(), "gid": os.getgid(), "groups": sorted(os.getgroups()),
                  "CapEff": status["CapEff"].strip(), "NoNewPrivs": status["NoNewPrivs"].strip(),
                  "home": os.environ["HOME"], "token": os.path.exists("/var/run/secrets/kubernetes.io"),
                  "writes": {path: writes(path) for path in ["/", "/src", "/etc", "/home/kubetune", "/tmp", "/dev/shm",
                                                             "/var/cache/kubetune", "/model", "/data", "/checkpoints",
                                                             "/etc/kubetune"]}}))
"""


def test_the_trainer_container_holds_exactly_the_rights_and_writable_paths_the_pod_spec_gives(rendered_pod):
    pod_spec, sources, root = rendered_pod
    result = run_container(pod_spec, sources, root / "probe", "kubetune-probe", ["python", "-c", PROBE], timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    seen = json.loads(result.stdout.strip().splitlines()[-1])
    assert (seen["uid"], seen["gid"]) == (NON_ROOT_UID, NON_ROOT_UID)
    assert NON_ROOT_UID in seen["groups"]
    assert seen["CapEff"] == "0000000000000000", "every capability dropped"
    assert seen["NoNewPrivs"] == "1", "allowPrivilegeEscalation: false"
    assert seen["token"] is False, "no service-account token without a volume for it"
    assert seen["home"].startswith("/var/cache/kubetune"), "HOME in the cache volume, not the read-only image"
    writes = seen["writes"]
    for read_only in ["/", "/src", "/etc", "/home/kubetune", "/model", "/data", "/etc/kubetune"]:
        assert writes[read_only] == "Read-only file system", (read_only, writes)
    for writable in ["/tmp", "/dev/shm", "/var/cache/kubetune", "/checkpoints"]:
        assert writes[writable] == "ok", (writable, writes)


def test_the_trainer_image_trains_the_operators_pod_from_read_only_claims_to_a_checkpoint_on_a_third(
        rendered_pod):
    """The pod's own command (python -m kubetune_trainer.pod --config /etc/kubetune/...) in the image, as UID
    10001 with a read-only root: it trains two steps and writes its checkpoints, owned by the pod's user."""
    pod_spec, sources, root = rendered_pod
    model_files = {path: path.stat().st_mtime_ns for path in Path(sources["model"]).rglob("*")}
    result = run_container(pod_spec, sources, root / "trainer", "kubetune-trainer-test")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    run = Path(sources["checkpoints"]) / "default" / "tiny" / "v0"
    checkpoints = sorted(path.name for path in run.glob("checkpoint-*"))
    assert checkpoints == ["checkpoint-1", "checkpoint-2"], sorted(p.name for p in run.iterdir())
    assert {path.stat().st_uid for path in run.rglob("*")} == {NON_ROOT_UID}
    assert {path: path.stat().st_mtime_ns for path in Path(sources["model"]).rglob("*")} == model_files


def test_a_model_file_the_pods_user_cannot_read_is_refused_by_name_not_reported_missing(rendered_pod):
    """A weights file saved by root through a temporary file (mode 0600, as transformers writes them) on the
    model's claim: safetensors would call it "No such file or directory"; the trainer refuses the job (exit 2,
    not retried) naming the file, its owner and mode, and the fix."""
    pod_spec, sources, root = rendered_pod
    weights = Path(sources["model"]) / "text_encoder" / "model.safetensors"
    os.chown(weights, 0, 0)
    weights.chmod(0o600)
    try:
        result = run_container(pod_spec, sources, root / "unreadable", "kubetune-unreadable-test", timeout=300)
    finally:
        os.chown(weights, NON_ROOT_UID, NON_ROOT_UID)
        weights.chmod(0o644)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    assert (f"spec.model.pretrained: /model/text_encoder/model.safetensors is not readable by the trainer's user "
            f"(UID {NON_ROOT_UID}; its owner is UID 0, mode 0600): make the model's files readable") in result.stderr, \
        result.stderr[-2000:]


def test_a_containers_environment_reaches_it_through_a_file_only_root_reads_not_podmans_arguments(tmp_path):
    """A Secret's value the kubelet resolved into the environment never appears on podman's command line
    (every process may read another's in /proc): it goes through an --env-file of mode 0600."""
    pod_spec = {"securityContext": {"runAsUser": NON_ROOT_UID}, "volumes": []}
    container = {"name": "c", "image": "localhost/kubetune/trainer:dev", "command": ["true"]}
    argv = container_runtime.podman_run(pod_spec, container, {"AWS_SECRET_ACCESS_KEY": "s3cr3t-value"}, "pod-c",
                                        tmp_path)
    assert not any("s3cr3t-value" in word for word in argv), argv
    env_file = Path(argv[argv.index("--env-file") + 1])
    assert env_file.read_text() == "AWS_SECRET_ACCESS_KEY=s3cr3t-value\n"
    assert env_file.stat().st_mode & 0o777 == 0o600
    with pytest.raises(container_runtime.PodRefused, match="env KEY: a value holding a line break"):
        container_runtime.podman_run(pod_spec, container, {"KEY": "two\nlines"}, "pod-c", tmp_path)



LIMITS_PROBE = """
import json, pathlib, sys
def read(path):
    return pathlib.Path(path).read_text().strip() if pathlib.Path(path).exists() else None
v1 = read("/sys/fs/cgroup/memory/memory.limit_in_bytes") is not None
print(json.dumps({"memory": read("/sys/fs/cgroup/memory/memory.limit_in_bytes" if v1 else "/sys/fs/cgroup/memory.max"),
                  "cpu": f'{read("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")} {read("/sys/fs/cgroup/cpu/cpu.cfs_period_us")}'
                         if v1 else read("/sys/fs/cgroup/cpu.max"),
                  "shares": read("/sys/fs/cgroup/cpu/cpu.shares" if v1 else "/sys/fs/cgroup/cpu.weight"),
                  "v1": v1}), flush=True)
if sys.argv[1:] == ["grow"]:
    held = bytearray(200 * 2**20)  # beyond the limit: the kernel kills the container
    print("not killed", flush=True)
"""


def test_a_containers_memory_and_cpu_limits_are_its_cgroups_and_memory_beyond_its_limit_kills_it(
        built_images, tmp_path):
    """The kubelet gives a container its resources as a kubelet does: limits.memory as its memory cgroup's
    limit (no swap beyond it), limits.cpu as a CFS quota, requests.cpu as shares; a container that grows
    past its memory limit is killed (137, reported OOMKilled), not left to take the node's memory."""
    pod_spec = {"securityContext": {"runAsUser": NON_ROOT_UID}, "volumes": []}
    container = {"name": "c", "image": "localhost/kubetune/trainer:dev", "command": ["python", "-c", LIMITS_PROBE],
                 "resources": {"limits": {"memory": "64Mi", "cpu": "500m"}, "requests": {"cpu": "250m"}}}
    runs = {}
    for case in ("fits", "grow"):
        argv = container_runtime.podman_run(pod_spec, {**container, "args": [case]}, {}, f"kubetune-limits-{case}",
                                            tmp_path)
        try:
            runs[case] = subprocess.run(argv, capture_output=True, text=True, timeout=120,
                                        cwd=container_runtime.runtime_dir(tmp_path, f"kubetune-limits-{case}"))
        finally:
            container_runtime.remove(f"kubetune-limits-{case}")
    fits, grows = runs["fits"], runs["grow"]
    assert fits.returncode == 0, fits.stderr
    seen = json.loads(fits.stdout)
    # cgroup v2 holds the shares as a weight (podman converts 256 shares to 10).
    assert (seen["memory"], seen["cpu"], seen["shares"]) == (
        str(64 * 2**20), "50000 100000", "256" if seen["v1"] else "10"), seen
    assert grows.returncode == 137 and "not killed" not in grows.stdout, (grows.returncode, grows.stdout, grows.stderr)
    # What the kubelet reports as the reason (OOMKilled), told apart from the container that fitted.
    assert [container_runtime.oom_killed(container_runtime.runtime_dir(tmp_path, f"kubetune-limits-{case}"))
            for case in ("fits", "grow")] == [False, True]


def test_a_killed_kubelets_containers_are_removed_by_the_next_and_a_running_ones_are_not(built_images, tmp_path):
    """A test session killed with its control plane leaves its real containers running under conmon: the
    next kubelet removes them (its own leftovers too), and leaves those of a kubelet that still runs."""
    live_state, dead_state, own_state = (tmp_path / name for name in ("live", "dead", "own"))
    live_state.mkdir()
    processes.record(os.getpid(), live_state / RECORD)  # "a kubelet that still runs": this process
    started = {}
    for state in (live_state, dead_state, own_state):
        run = subprocess.run([*container_runtime.run_command(), "--detach", "--label", f"{POD_DIR_LABEL}={state / 'pods'}",
                              "--entrypoint", "sleep", "localhost/kubetune/trainer:dev", "120"],
                             capture_output=True, text=True, check=True)
        started[state.name] = run.stdout.strip()
    try:
        removed = remove_orphaned_containers(own_state / "pods")
        assert sorted(removed) == sorted([started["dead"][:12], started["own"][:12]])
        left = container_runtime.labelled(POD_DIR_LABEL)
        assert [c[:12] for c in left.get(str(live_state / "pods"), [])] == [started["live"][:12]]
    finally:
        for container in started.values():
            container_runtime.remove(container)
