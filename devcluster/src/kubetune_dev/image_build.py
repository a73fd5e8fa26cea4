"""`make images`: the operator and trainer images, built from their Dockerfiles with podman.

    python -m kubetune_dev.image_build [--tag TAG] [--repository REPO]

tags `REPO/operator:TAG` and `REPO/trainer:TAG` (default `kubetune/…:dev`, `IMAGE_TAG` and
`IMAGE_REPOSITORY` override) in the local image store, where podman names them `localhost/kubetune/…`.

- Tools: podman (its `build` is buildah's code), runc and, for the stand-in base, mmdebstrap. Missing ones are
  installed from the machine's Debian packages when run as root, else named with the command to run.
- Base: the Dockerfiles' `FROM` image. Where it is neither in the store nor pullable (this machine
  reaches no registry) devcluster/standin-base.sh builds a LOCAL STAND-IN from Debian bookworm's
  packages under that name; an image built on it says so in its `org.kubetune.base` label.
- Cached by content: each image carries `org.kubetune.source`, a digest of its Dockerfile, the files it
  copies (what .dockerignore leaves) and its base image's ID. An image whose label matches is not built
  again; a changed source rebuilds only the layers from the first COPY of our code (the dependencies'
  layer, keyed by pyproject.toml alone, stays).
"""
from __future__ import annotations

import argparse
import fnmatch
import hashlib
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
# Image name -> its Dockerfile, relative to the repository root (the build context).
DOCKERFILES = {"operator": "Dockerfile", "trainer": "trainer_image/Dockerfile"}
STANDIN_SCRIPT = REPO / "devcluster" / "standin-base.sh"
SOURCE_LABEL = "org.kubetune.source"
BASE_LABEL = "org.kubetune.base"
STANDIN_LABEL = "org.kubetune.standin"
# Debian package -> the command it brings. Installed with their recommends (netavark, the CNI plugins,
# fuse-overlayfs, catatonit...), as podman was checked on this machine.
TOOLS = {"podman": "podman", "buildah": "buildah", "mmdebstrap": "mmdebstrap", "runc": "runc"}
# runc sets the container's rlimits from podman's defaults (nofile 1048576, nproc 4194304), which this
# machine's sandbox refuses above its own hard limits; for nproc, above 32768 (measured: 32768 runs,
# 65536 is refused with "error setting rlimit type 6").
NPROC_CEILING = 32768


class BuildError(RuntimeError):
    """The images cannot be built; the message says why and what to do."""


@dataclass(frozen=True)
class Built:
    name: str
    seconds: float
    size_bytes: int
    cached: bool


def image_name(name: str, repository: str, tag: str) -> str:
    return f"{repository}/{name}:{tag}"


def ulimit_flags() -> list[str]:
    """podman's --ulimit flags at or below this machine's hard limits."""
    nofile = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    nproc = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    nproc = NPROC_CEILING if nproc == resource.RLIM_INFINITY else min(nproc, NPROC_CEILING)
    nofile = 1048576 if nofile == resource.RLIM_INFINITY else nofile
    return ["--ulimit", f"nofile={nofile}:{nofile}", "--ulimit", f"nproc={nproc}:{nproc}"]


def base_image(dockerfile: Path) -> str:
    """The FROM image, fully qualified as podman stores it (`python:3.11` is docker.io/library/python:3.11)."""
    names = [line.split()[1] for line in dockerfile.read_text().splitlines() if line.startswith("FROM ")]
    if len(names) != 1:
        raise BuildError(f"{dockerfile}: expected one FROM line, found {len(names)}")
    name = names[0]
    first = name.split("/")[0]
    if "/" not in name:
        return f"docker.io/library/{name}"
    if "." not in first and ":" not in first and first != "localhost":
        return f"docker.io/{name}"
    return name


def ignore_patterns() -> list[str]:
    lines = (REPO / ".dockerignore").read_text().splitlines()
    return [line.strip() for line in lines if line.strip() and not line.startswith("#")]


def ignored(relative: Path, patterns: list[str]) -> bool:
    """.dockerignore's rule for the two forms it uses: `**/PATTERN` matches any path component, and
    `PATTERN` the path from the context's root."""
    for pattern in patterns:
        if pattern.startswith("**/"):
            if any(fnmatch.fnmatch(part, pattern[3:]) for part in relative.parts):
                return True
        elif fnmatch.fnmatch(str(relative), pattern) or fnmatch.fnmatch(relative.parts[0], pattern):
            return True
    return False


def copied_files(dockerfile: Path) -> list[Path]:
    """The files the Dockerfile's COPY lines take from the context, after .dockerignore."""
    patterns = ignore_patterns()
    sources = [word for line in dockerfile.read_text().splitlines() if line.startswith("COPY ")
               for word in line.split()[1:-1] if not word.startswith("--")]
    files = []
    for source in sources:
        path = REPO / source
        candidates = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
        files += [p for p in candidates if not ignored(p.relative_to(REPO), patterns)]
    return files


def source_digest(dockerfile: Path, base_id: str) -> str:
    digest = hashlib.sha256(base_id.encode())
    for path in [dockerfile, REPO / ".dockerignore", *copied_files(dockerfile)]:
        digest.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:20]


def podman(*args: str, capture: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["podman", *args], capture_output=capture, text=True, check=False)


def inspect(name: str) -> dict | None:
    result = podman("image", "inspect", name)
    if result.returncode:
        return None
    return json.loads(result.stdout)[0]


def labels(found: dict | None) -> dict:
    """The labels of an inspected image (none for an absent one)."""
    return (found or {}).get("Labels") or {}


def ensure_tools() -> None:
    missing = [package for package, command in TOOLS.items() if shutil.which(command) is None]
    if not missing:
        return
    if os.geteuid() != 0:
        raise BuildError(f"make images needs {', '.join(missing)}: install them (as root: "
                         f"apt-get install {' '.join(missing)}) and run it again")
    print(f"make images: installing {', '.join(missing)} from Debian's packages", flush=True)
    install = ["apt-get", "install", "-y", "-q", *missing]
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    if subprocess.run(install, env=env).returncode:
        # A machine image without package lists (many delete /var/lib/apt/lists): fetch them, then again.
        subprocess.run(["apt-get", "update", "-q"], env=env, check=True)
        subprocess.run(install, env=env, check=True)


def ensure_base(name: str) -> str:
    """The base image's ID: the real one if present or pullable, else the stand-in (built when stale)."""
    found = inspect(name)
    if found is not None and not labels(found).get(STANDIN_LABEL):
        return found["Id"]
    if found is None and podman("pull", "--quiet", name).returncode == 0:
        return inspect(name)["Id"]
    print(f"make images: {name} cannot be pulled here: using a LOCAL STAND-IN built from Debian bookworm "
          f"({STANDIN_SCRIPT.relative_to(REPO)})", flush=True)
    subprocess.run(["bash", str(STANDIN_SCRIPT), name], check=True)
    return inspect(name)["Id"]


def build(name: str, dockerfile: Path, target: str, base_id: str, base: str) -> Built:
    digest = source_digest(dockerfile, base_id)
    current = inspect(target)
    if labels(current).get(SOURCE_LABEL) == digest:
        return Built(name, 0.0, int(current["Size"]), cached=True)
    print(f"make images: building {target} from {dockerfile.relative_to(REPO)}", flush=True)
    start = time.monotonic()
    standin = "stand-in " if labels(inspect(base)).get(STANDIN_LABEL) else ""
    # --network host: the RUN steps reach PyPI as this machine does (podman's bridge is a private range).
    result = podman("build", "--pull=never", "--network", "host", *ulimit_flags(),
                    "--label", f"{SOURCE_LABEL}={digest}", "--label", f"{BASE_LABEL}={standin}{base}",
                    "--tag", target, "--file", str(dockerfile), str(REPO), capture=False)
    if result.returncode:
        raise BuildError(f"building {target} from {dockerfile.relative_to(REPO)} failed (exit {result.returncode}): "
                         "its output is above")
    seconds = time.monotonic() - start
    built = inspect(target)
    if current and current["Id"] != built["Id"]:
        # The image this tag named before, now untagged: removed, unless a container or image still uses it.
        podman("rmi", current["Id"])
    return Built(name, seconds, int(built["Size"]), cached=False)


def build_all(repository: str, tag: str) -> list[Built]:
    ensure_tools()
    bases = {name: base_image(REPO / path) for name, path in DOCKERFILES.items()}
    base_ids = {base: ensure_base(base) for base in sorted(set(bases.values()))}
    return [build(name, REPO / path, image_name(name, repository, tag), base_ids[bases[name]], bases[name])
            for name, path in DOCKERFILES.items()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kubetune_dev.image_build", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tag", default=os.environ.get("IMAGE_TAG") or "dev")
    parser.add_argument("--repository", default=os.environ.get("IMAGE_REPOSITORY") or "kubetune")
    args = parser.parse_args(argv)
    try:
        built = build_all(args.repository, args.tag)
    except BuildError as error:
        print(f"make images: {error}", file=sys.stderr)
        return 1
    for image in built:
        how = "cached (sources unchanged)" if image.cached else f"built in {image.seconds:.0f} s"
        print(f"{image_name(image.name, args.repository, args.tag)}: {image.size_bytes / 1e9:.2f} GB, {how}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
