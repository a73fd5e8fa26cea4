"""Models from the Hugging Face Hub: a revision pinned to a commit, mirrored once into S3.

A (model, commit) lives in the mirror at <mirror>/hub/<org>/<name>/<commit>/, read from then on
by every pod with the s3:// path every other model takes (storage.inputs.local_copy, with its
size-and-time check). Its marker object MARKER is written last: a prefix without it is not a
mirror yet.

One downloader among all pods and jobs: a lock object (lock_of; outside the model's prefix), created with a
conditional put (If-None-Match: *; AWS S3, MinIO and the versitygw the dev cluster runs refuse a
second create with 412). Whoever creates it downloads, file by file (the disk holds one file at a
time, and a takeover skips files already mirrored whole); the others wait for the marker. The holder
rewrites the lock every HEARTBEAT_SECONDS; a lock older than stale_seconds() is a holder that died,
and a waiter removes it and tries again. Chosen over an operator-run download Job: no new operator
code path or Secret-reading rights, and `kubetune models mirror` and `kubetune train` share it.

Errors of the hub become one line (a ConfigError) naming the spec field: a gated or private model
names the field that holds the token, a missing revision names the revision's field.
"""
from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
from pathlib import Path

from kubetune_api.hub import HubInput
from kubetune_trainer.errors import ConfigError, InputsInFlux
from kubetune_trainer.storage import s3
from kubetune_trainer.storage.uri import parse_s3

log = logging.getLogger(__name__)
MARKER = ".kubetune-mirrored.json"
LOCKS = ".locks"  # <mirror>/hub/.locks/<org>/<name>/<commit>: one lock object per (model, commit)
HEARTBEAT_SECONDS = 30.0
WAIT_POLL_SECONDS = 1.0
COMMIT = re.compile(r"[0-9a-f]{40}")
JOB_TOKEN_HINT = "put a token with access to it under key HF_TOKEN of a Secret and name it in spec.model.hubTokenSecret"


def stale_seconds() -> float:
    """How old a lock may grow before its holder counts as dead (several missed heartbeats)."""
    return float(os.environ.get("KUBETUNE_HUB_LOCK_STALE_SECONDS", 10 * HEARTBEAT_SECONDS))


def endpoint() -> str:
    """The hub's address: HF_ENDPOINT as the environment says now (huggingface_hub reads it once, at import)."""
    from huggingface_hub import constants

    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def hub_cache() -> str:
    """huggingface_hub's cache folder as the environment says now (HF_HUB_CACHE, else HF_HOME/hub)."""
    from huggingface_hub import constants

    if os.environ.get("HF_HUB_CACHE"):
        return os.environ["HF_HUB_CACHE"]
    return os.path.join(os.environ["HF_HOME"], "hub") if os.environ.get("HF_HOME") else constants.HF_HUB_CACHE


def _api():
    from huggingface_hub import HfApi

    return HfApi(endpoint=endpoint())


def refusal(err: Exception, item: HubInput, token: str | None, token_hint: str) -> ConfigError | None:
    """The one-line error for what the hub answered, or None for what is not the input's fault."""
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError, RevisionNotFoundError

    status = getattr(getattr(err, "response", None), "status_code", None)
    if isinstance(err, RevisionNotFoundError):
        return ConfigError(f"{item.revision_field or item.field}: revision {item.revision!r} not found in "
                           f"{item.repo_id} on {endpoint()}: name one of its tags, branches or commits")
    if isinstance(err, GatedRepoError) or status in (401, 403):
        with_token = "with the token given" if token else "without a token"
        return ConfigError(f"{item.field}: {item.repo_id} is gated or private and {endpoint()} refused it ({status}) "
                           f"{with_token}: {token_hint}")
    if isinstance(err, RepositoryNotFoundError) or (isinstance(err, HfHubHTTPError) and status == 404):
        return ConfigError(f"{item.field}: {item.repo_id} not found on {endpoint()} (a hub id reads org/name)")
    return None


def resolve_commit(item: HubInput, token: str | None, token_hint: str = JOB_TOKEN_HINT) -> str:
    """The commit a tag, branch or commit of the model names now (asked of the hub)."""
    import httpx2

    try:
        sha = _api().model_info(item.repo_id, revision=item.revision, token=token).sha
    except (httpx2.ConnectError, httpx2.TimeoutException) as err:
        # Not the spec's fault, and perhaps passing: a pod restarts and asks again.
        raise InputsInFlux(f"{item.field}: cannot reach the hub at {endpoint()} for {item.repo_id} ({err}); "
                           "check the network (or HF_ENDPOINT / the chart's models.hubEndpoint)") from None
    except Exception as err:
        refused = refusal(err, item, token, token_hint)
        if refused is None:
            raise
        raise refused from None
    if not sha or not COMMIT.fullmatch(sha):
        raise ConfigError(f"{item.field}: {endpoint()} named no commit for {item.repo_id} at {item.revision!r}")
    return sha


def repo_files(item: HubInput, commit: str, token: str | None) -> dict[str, int]:
    """Every file of the model at the commit: path -> size."""
    from huggingface_hub.hf_api import RepoFile

    entries = _api().list_repo_tree(item.repo_id, recursive=True, revision=commit, token=token)
    return {entry.path: entry.size for entry in entries if isinstance(entry, RepoFile)}


def mirror_uri_of(mirror: str, repo_id: str, commit: str) -> str:
    return f"{mirror.rstrip('/')}/hub/{repo_id}/{commit}"


def lock_of(mirror: str, repo_id: str, commit: str):
    """The lock of a (model, commit): beside the mirror's models, never inside one (readers copy a model's whole prefix)."""
    return parse_s3(f"{mirror.rstrip('/')}/hub/{LOCKS}/{repo_id}/{commit}")


def is_mirrored(uri: str) -> bool:
    return s3.read_text(parse_s3(uri).child(MARKER)) is not None


def mirror(item: HubInput, commit: str, mirror: str, token: str | None, staging: Path,
           token_hint: str = JOB_TOKEN_HINT) -> str:
    """The s3:// URI of the model's files at the commit, downloaded from the hub by exactly one of
    all the processes that ask at once (the others wait for it)."""
    uri = mirror_uri_of(mirror, item.repo_id, commit)
    location = parse_s3(uri)
    lock = lock_of(mirror, item.repo_id, commit)
    announced = False
    while not is_mirrored(uri):
        if s3.write_text_if_absent(lock, json.dumps({"host": os.uname().nodename, "pid": os.getpid()})):
            try:
                if not is_mirrored(uri):  # the previous holder may have finished between our two looks
                    with _Heartbeat(lock):
                        files = _download(item, commit, token, staging, location, token_hint)
                    # Created once, never rewritten: readers copy the whole prefix, and every node
                    # must find the same files (and times) in it.
                    s3.write_text_if_absent(location.child(MARKER), json.dumps(
                        {"repo": item.repo_id, "commit": commit, "files": files}))
                    log.info("%s@%s: mirrored %d files to %s", item.repo_id, commit, len(files), uri)
            finally:
                s3.delete_object(lock)
            break
        if not announced:
            log.info("%s@%s: another pod is mirroring it to %s; waiting", item.repo_id, commit, uri)
            announced = True
        age = s3.object_age_seconds(lock)
        if age is not None and age > stale_seconds() and not is_mirrored(uri):
            log.warning("%s: its downloader stopped writing %s %.0f s ago; taking over", uri, lock.uri, age)
            s3.delete_object(lock)
            continue
        time.sleep(WAIT_POLL_SECONDS)
    return uri


def _download(item: HubInput, commit: str, token: str | None, staging: Path, location,
              token_hint: str) -> dict[str, int]:
    """Hub -> S3 one file at a time; files a dead holder already mirrored whole are kept."""
    from huggingface_hub import hf_hub_download

    try:
        files = repo_files(item, commit, token)
        there = s3.list_objects(location)
        for name, size in sorted(files.items()):
            if there.get(name) == size:
                continue
            folder = staging / commit
            path = Path(hf_hub_download(item.repo_id, name, revision=commit, token=token, local_dir=folder,
                                             endpoint=endpoint(), cache_dir=hub_cache()))
            s3.upload_file(path, location.child(name))
            path.unlink()
    except ConfigError:
        raise
    except Exception as err:
        refused = refusal(err, item, token, token_hint)
        if refused is None:
            raise
        raise refused from None
    finally:
        shutil.rmtree(staging / commit, ignore_errors=True)
    return files


def download_local(item: HubInput, commit: str, token: str | None, token_hint: str = JOB_TOKEN_HINT) -> str:
    """Without a mirror: the model's files at the commit in this machine's hub cache (HF_HOME)."""
    from huggingface_hub import snapshot_download

    try:
        return snapshot_download(item.repo_id, revision=commit, token=token, endpoint=endpoint(), cache_dir=hub_cache())
    except Exception as err:
        refused = refusal(err, item, token, token_hint)
        if refused is None:
            raise
        raise refused from None


class _Heartbeat:
    """Rewrites the lock while the download runs, so waiters can tell a live holder from a dead one."""

    def __init__(self, lock):
        self.lock, self.stopped = lock, threading.Event()
        self.thread = threading.Thread(target=self._beat, name="hub-lock-heartbeat", daemon=True)

    def _beat(self) -> None:
        while not self.stopped.wait(min(HEARTBEAT_SECONDS, stale_seconds() / 4)):
            s3.write_text(self.lock, json.dumps({"host": os.uname().nodename, "pid": os.getpid(),
                                                 "beat": time.time()}))

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *_):
        self.stopped.set()
        self.thread.join()
