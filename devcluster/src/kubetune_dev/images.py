"""Which local program stands in for each container image: one explicit table.

The process kubelet runs no images. A pod's `image` picks an entry here; the container's
`command` and `args` then replace the entry's ENTRYPOINT and CMD exactly as they would replace
the image's, so what the pod spec says is what runs. To run a new image locally, add a line.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

# The virtualenv that runs kubetune: its python has torch, kopf and kubetune itself installed.
VENV_BIN = str(Path(sys.executable).parent)
SHIMS = str(Path(__file__).parent / "shims")
SYSTEM_PATH = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


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


_PYTHON = LocalImage(cmd=("python3",), path=(VENV_BIN, *SYSTEM_PATH))

# Image repository (registry and tag stripped, see `repository`) -> local stand-in.
IMAGES: dict[str, LocalImage] = {
    # kubetune's own images: the operator and the trainer, from this checkout's virtualenv.
    "kubetune/operator": LocalImage(entrypoint=("python", "-m", "kubetune_operator"),
                                    path=(VENV_BIN, *SYSTEM_PATH)),
    "kubetune/trainer": LocalImage(entrypoint=("python", "-m", "kubetune_trainer"),
                                   path=(VENV_BIN, *SYSTEM_PATH)),
    # Plain Python images (tests run a few lines of torch.distributed with them).
    "python": _PYTHON,
    "pytorch/pytorch": _PYTHON,
    # The training operator's init container for PyTorchJob workers (`sh -c 'until nslookup …'`).
    "alpine": LocalImage(cmd=("/bin/sh",), path=(SHIMS, *SYSTEM_PATH)),
    "busybox": LocalImage(cmd=("/bin/sh",), path=(SHIMS, *SYSTEM_PATH)),
}


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
