"""Which local program stands in for each container image: one explicit table (and which images
run as real containers instead: REAL_IMAGE_REGISTRY).

The process kubelet runs no images. A pod's `image` picks an entry here; the container's
`command` and `args` then replace the entry's ENTRYPOINT and CMD exactly as they would replace
the image's, so what the pod spec says is what runs. To run a new image locally, add a line.

The image's files. A real image carries its interpreter and packages at fixed paths inside the
container, and a pod's volume over /tmp (the operator's, a test pod's) hides nothing of it. Here
the packages are this checkout's virtualenv and sources, which may live anywhere, /tmp included.
So every container sees them at one fixed place, IMAGE_ROOT, whatever the checkout's path: the
sandbox mounts a small tmpfs there and binds the virtualenv at IMAGE_ROOT/venv and the checkout
at IMAGE_ROOT/src, read-only, before it mounts the pod's volumes (a volume at IMAGE_ROOT would
hide them, as it would hide an image's files). PATH names IMAGE_ROOT/venv/bin, and PYTHONPATH
the source roots under IMAGE_ROOT/src, because the editable install records the checkout's own
path. What stays host-dependent is the base interpreter the virtualenv was made from
(`home` in its pyvenv.cfg, e.g. /usr or ~/.pyenv), which no pod here mounts over.
"""
from __future__ import annotations

import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path

IMAGE_ROOT = "/opt/kubetune-dev"
IMAGE_VENV = f"{IMAGE_ROOT}/venv"
IMAGE_SRC = f"{IMAGE_ROOT}/src"
# The host side of the two binds: the virtualenv running kubetune and the checkout it came from.
HOST_VENV = sys.prefix
HOST_SRC = str(Path(__file__).resolve().parents[3])

VENV_BIN = f"{IMAGE_VENV}/bin"
SHIMS = f"{IMAGE_SRC}/devcluster/src/kubetune_dev/shims"
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
PACKAGES = ("kubetune_api", "kubetune_cli", "kubetune_operator", "kubetune_trainer", "kubetune_dev")


def image_mounts() -> list[dict]:
    """The binds that make up the image's files, for the sandbox (mounted before any volume)."""
    return [{"source": HOST_VENV, "target": IMAGE_VENV, "readOnly": True},
            {"source": HOST_SRC, "target": IMAGE_SRC, "readOnly": True}]


def source_roots() -> tuple[str, ...]:
    """Where kubetune's packages are inside a container: the directory holding each package, moved
    under IMAGE_SRC. A package installed into the virtualenv (not editable) needs no entry."""
    roots = []
    for package in PACKAGES:
        spec = importlib.util.find_spec(package)  # finds, does not import
        if spec is None or not spec.submodule_search_locations:
            continue
        parent = Path(list(spec.submodule_search_locations)[0]).resolve().parent
        if parent.is_relative_to(HOST_SRC):
            root = f"{IMAGE_SRC}/{parent.relative_to(HOST_SRC)}"
            if root not in roots:
                roots.append(root)
    return tuple(roots)


@dataclass(frozen=True)
class LocalImage:
    """What an image provides: its ENTRYPOINT, its CMD and the directories of its PATH."""

    entrypoint: tuple[str, ...] = ()
    cmd: tuple[str, ...] = ()
    path: tuple[str, ...] = SYSTEM_PATH
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, command: list[str] | None, args: list[str] | None) -> list[str]:
        """Kubernetes semantics: `command` replaces ENTRYPOINT (and drops CMD), `args` replaces CMD."""
        if command:
            return [*command, *(args or [])]
        return [*self.entrypoint, *(args if args else self.cmd)]


_KUBETUNE_ENV = {"PYTHONPATH": ":".join(source_roots())}
_PYTHON = LocalImage(cmd=("python3",), path=(VENV_BIN, *SYSTEM_PATH), env=_KUBETUNE_ENV)

# Image repository (registry and tag stripped, see `repository`) -> local stand-in.
IMAGES: dict[str, LocalImage] = {
    # kubetune's own images: the operator and the trainer, from this checkout's virtualenv.
    "kubetune/operator": LocalImage(entrypoint=("python", "-m", "kubetune_operator"),
                                    path=(VENV_BIN, *SYSTEM_PATH), env=_KUBETUNE_ENV),
    "kubetune/trainer": LocalImage(entrypoint=("python", "-m", "kubetune_trainer"),
                                   path=(VENV_BIN, *SYSTEM_PATH), env=_KUBETUNE_ENV),
    # Plain Python images (tests run a few lines of torch.distributed with them).
    "python": _PYTHON,
    "pytorch/pytorch": _PYTHON,
    # The training operator's init container for PyTorchJob workers (`sh -c 'until nslookup …'`).
    "alpine": LocalImage(cmd=("/bin/sh",), path=(SHIMS, *SYSTEM_PATH)),
    "busybox": LocalImage(cmd=("/bin/sh",), path=(SHIMS, *SYSTEM_PATH)),
}


# An image named on this registry is one `make images` built into this machine's podman store: its
# containers run as real containers of that image (kubetune_dev.container_runtime), under the pod's
# securityContext. Every other name runs as its local stand-in program below.
REAL_IMAGE_REGISTRY = "localhost"


def runs_as_real_container(image: str) -> bool:
    return image.split("/", 1)[0] == REAL_IMAGE_REGISTRY and "/" in image


class UnknownImage(LookupError):
    pass


def repository(image: str) -> str:
    """`ghcr.io/kubetune/trainer:0.1@sha256:…` -> `kubetune/trainer`; `docker.io/library/python:3.11` -> `python`."""
    name = image.split("@", 1)[0]
    last = name.rsplit("/", 1)[-1]
    if ":" in last:
        name = name[: len(name) - len(last)] + last.split(":", 1)[0]
    parts = name.split("/")
    # A first component with a dot, a colon or `localhost` is a registry host.
    if len(parts) > 1 and ("." in parts[0] or ":" in parts[0] or parts[0] == "localhost"):
        parts = parts[1:]
    if parts[0] == "library" and len(parts) > 1:
        parts = parts[1:]
    return "/".join(parts)


def resolve(image: str) -> LocalImage:
    try:
        return IMAGES[repository(image)]
    except KeyError:
        known = ", ".join(sorted(IMAGES))
        raise UnknownImage(f"image {image!r} has no local stand-in (known: {known}); "
                           f"add it to kubetune_dev.images.IMAGES") from None
