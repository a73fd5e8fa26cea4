"""The pod's termination message: text Kubernetes keeps in the pod's status after the container exits.

Written only in a pod the operator rendered (TrainerEnv.pod_name, set there by the downward API) and
only where the kubelet made the file: a file at the path is not proof of a pod (the local control
plane's process kubelet leaves the mount point /dev/termination-log on its host), and a run on a
workstation must never write into the host's /dev.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path

from kubetune_api.contract import TERMINATION_MESSAGE_PATH, TrainerEnv

log = logging.getLogger("kubetune.trainer")


def write_termination_message(text: str, path: Path = Path(TERMINATION_MESSAGE_PATH)) -> bool:
    """Leave TEXT as the container's termination message; whether it was written."""
    if not TrainerEnv.from_env(os.environ).pod_name or not path.exists():
        return False
    try:
        path.write_text(text)
    except OSError as err:  # read-only or gone: stderr (and the operator's poll) are the other ways
        log.warning("the termination message could not be written to %s: %s", path, err)
        return False
    return True
