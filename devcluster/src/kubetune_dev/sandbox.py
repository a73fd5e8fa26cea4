"""The first program of every container: private mounts and hostname, then exec.

The process kubelet starts `python -m kubetune_dev.sandbox SPEC.json` (and `dev up` starts the
training operator that way, to give it its certificate directory). In a new mount and UTS
namespace (we run as root), it mounts the image's files at their fixed place (images.py), then
bind-mounts the pod's hosts file over /etc/hosts and each volume directory over its container
path, sets the pod's hostname, and execs the container command.
Only this process tree sees those mounts; the host's files stay as they are. Name lookups from
C code (torch's c10d store, gloo) read /etc/hosts, which is why a Python-level patch would not do.
"""
from __future__ import annotations

import ctypes
import json
import os
import socket
import sys

CLONE_NEWNS = 0x00020000
CLONE_NEWUTS = 0x04000000
MS_RDONLY = 0x1
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 0x40000

_libc = ctypes.CDLL(None, use_errno=True)


def _check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def _mount(source: str | None, target: str, flags: int) -> None:
    src = source.encode() if source else None
    _check(_libc.mount(src, target.encode(), None, flags, None), f"mount {source} on {target}")


def bind(source: str, target: str, read_only: bool) -> None:
    """Bind SOURCE over TARGET, creating an empty mount point of the right kind if needed."""
    if not os.path.exists(target):
        if os.path.isdir(source):
            os.makedirs(target, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            open(target, "a").close()
    _mount(source, target, MS_BIND | MS_REC)
    if read_only:
        _mount(None, target, MS_BIND | MS_REMOUNT | MS_RDONLY)


def image_root(root: str) -> None:
    """A small private tmpfs at ROOT to hold the image's mount points: nothing is created in
    the host's directory but ROOT itself, and whatever the host has there stays unseen."""
    os.makedirs(root, exist_ok=True)
    _check(_libc.mount(b"tmpfs", root.encode(), b"tmpfs", 0, b"size=1m,mode=0755"), f"mount tmpfs on {root}")


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    image = spec.get("image") or {"root": None, "mounts": []}
    # Shallow targets first (a volume at /data before one at /data/cache), as runtimes do.
    mounts = sorted(spec["mounts"], key=lambda m: m["target"].rstrip("/").count("/"))
    _check(_libc.unshare(CLONE_NEWNS | CLONE_NEWUTS), "unshare")
    # Keep our mounts from propagating back to the host's mount namespace.
    _mount(None, "/", MS_REC | MS_PRIVATE)
    # Open every source before mounting anything (and after unshare: a bind source must belong
    # to this namespace). A volume mounted at /tmp would otherwise hide the sources of the
    # mounts after it whenever the state directory (or the checkout) lives under /tmp.
    image_sources = [os.open(m["source"], os.O_PATH) for m in image["mounts"]]
    sources = [os.open(m["source"], os.O_PATH) for m in mounts]
    hosts = os.open(spec["hosts"], os.O_PATH) if "hosts" in spec else None
    if "hostname" in spec:
        socket.sethostname(spec["hostname"])
    # The image first, the volumes over it: as in a container, a volume hides the image's files.
    if image["root"]:
        image_root(image["root"])
    for m, fd in zip(image["mounts"], image_sources):
        bind(f"/proc/self/fd/{fd}", m["target"], m["readOnly"])
    if hosts is not None:
        bind(f"/proc/self/fd/{hosts}", "/etc/hosts", read_only=True)
    for m, fd in zip(mounts, sources):
        bind(f"/proc/self/fd/{fd}", m["target"], m["readOnly"])
    for fd in image_sources + sources + ([hosts] if hosts is not None else []):
        os.close(fd)
    os.chdir(spec["workingDir"])
    argv = spec["argv"]
    try:
        os.execvpe(argv[0], argv, spec["env"])
    except FileNotFoundError:
        print(f"sandbox: executable {argv[0]!r} not found in PATH {spec['env'].get('PATH')}",
              file=sys.stderr)
        sys.exit(127)


if __name__ == "__main__":
    main(sys.argv[1])
