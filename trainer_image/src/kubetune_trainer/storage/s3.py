"""The S3 side of the storage layer, over boto3.

Configuration comes from the environment the operator renders into the pod: AWS_ENDPOINT_URL
(MinIO and other S3-compatible stores), AWS_DEFAULT_REGION, KUBETUNE_S3_PATH_STYLE, and the
credentials either as AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY (from a Secret) or whatever the
default AWS chain finds (IRSA, instance profile). Nothing here logs a credential.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import datetime, timezone
from functools import lru_cache
from pathlib import Path

from kubetune_api.contract import TrainerEnv
from kubetune_trainer.storage.confine import confined
from kubetune_trainer.storage.uri import S3Location

# The operator's path-style setting (TrainerEnv.s3_path_style), read raw: it also keys the client cache.
PATH_STYLE = TrainerEnv.NAMES["s3_path_style"]

log = logging.getLogger(__name__)
PARALLEL_FILES = 8
# Connections the client keeps: up to this many threads fetch at once without waiting for one.
POOL_CONNECTIONS = PARALLEL_FILES * 4
MULTIPART_CHUNK = 64 * 1024 * 1024
# An object up to this size is fetched in one GET held in memory (s3.download_file): at most this
# much per fetching thread.
SINGLE_GET_MAX = 8 * 1024 * 1024


def _path_style() -> bool | None:
    value = os.environ.get(PATH_STYLE, "").lower()
    return {"true": True, "1": True, "false": False, "0": False}.get(value)


def client():
    """One client per S3 configuration of the environment (boto3 clients are thread-safe): a run
    started in-process with spec.s3's endpoint (kubetune train) gets its own."""
    return _client(os.environ.get("AWS_ENDPOINT_URL"), os.environ.get("AWS_DEFAULT_REGION"),
                   os.environ.get(PATH_STYLE), os.environ.get("AWS_ACCESS_KEY_ID"))


def forget_clients() -> None:
    """Drop the cached clients (after credentials changed in the environment, e.g. a new test server)."""
    _client.cache_clear()


# A forked process (a DataLoader worker reading streamed images) makes its own client: the
# parent's carries locks (connection pool, adaptive retry's rate limiter) another thread may have
# held at the fork, which would then stay held in the child forever.
os.register_at_fork(after_in_child=forget_clients)


def max_attempts() -> int:
    """10 attempts (about 15 s against an endpoint that refuses), or AWS_MAX_ATTEMPTS as the AWS tools
    read it: a shell that prefers a quick answer from a store that is down sets it lower."""
    text = os.environ.get("AWS_MAX_ATTEMPTS", "")
    return int(text) if text.isascii() and text.isdigit() and int(text) > 0 else 10


@lru_cache(maxsize=8)
def _client(endpoint: str | None, region: str | None, path_style_setting: str | None, access_key: str | None):
    """Adaptive retries ride out blips. The arguments only key the cache; boto3 reads the environment."""
    import boto3
    from botocore.config import Config

    path_style = _path_style()
    if path_style is None:  # self-hosted endpoints rarely have wildcard DNS for virtual hosts
        path_style = bool(os.environ.get("AWS_ENDPOINT_URL"))
    config = Config(
        retries={"max_attempts": max_attempts(), "mode": "adaptive"},
        s3={"addressing_style": "path" if path_style else "auto"},
        max_pool_connections=POOL_CONNECTIONS,
    )
    # A session of its own: boto3's default session caches the credentials it first resolved, so a
    # client made after the environment changed (a test's second S3 server) would sign with old keys.
    import botocore.session

    core = botocore.session.get_session()
    # Leave timestamps as text: botocore's parser took a quarter of listing a 20,000-image data
    # set; epoch_ns reads them where a mirror needs them (about 2 us each).
    core.get_component("response_parser_factory").set_parser_defaults(timestamp_parser=str)
    return boto3.session.Session(botocore_session=core).client("s3", config=config)


def _transfer_config():
    from boto3.s3.transfer import TransferConfig

    return TransferConfig(multipart_threshold=MULTIPART_CHUNK, multipart_chunksize=MULTIPART_CHUNK,
                          max_concurrency=4, use_threads=True)


def _contents(location: S3Location) -> Iterator[tuple[str, dict]]:
    """(relative key, listing entry) of every object under the prefix."""
    paginator = client().get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=location.bucket, Prefix=location.prefix):
        for item in page.get("Contents", []):
            yield item["Key"][len(location.prefix):], item


def list_objects(location: S3Location) -> dict[str, int]:
    """Every object under the prefix: relative key -> size."""
    return {name: item["Size"] for name, item in _contents(location)}


@dataclass(frozen=True)
class StoredObject:
    size: int
    modified_ns: int  # LastModified, in nanoseconds since the epoch: the mtime its local mirror gets
    etag: str = ""    # changes with the content where size and a second-resolution time may not


def list_stored_objects(location: S3Location) -> dict[str, StoredObject]:
    """Every object under the prefix: relative key -> its size, time and ETag."""
    return {name: StoredObject(item["Size"], epoch_ns(item["LastModified"]), item.get("ETag", ""))
            for name, item in _contents(location)}


def epoch_ns(timestamp: str) -> int:
    """A listing's LastModified (ISO 8601 with its zone, e.g. 2026-11-26T17:50:30.000Z, as
    ListObjectsV2 sends it) in whole nanoseconds since the epoch: integer arithmetic, so every node
    computes the same mtime."""
    since_epoch = datetime.fromisoformat(timestamp) - datetime(1970, 1, 1, tzinfo=timezone.utc)
    return (since_epoch.days * 86_400 + since_epoch.seconds) * 10**9 + since_epoch.microseconds * 1000


def list_children(location: S3Location) -> list[str]:
    """Names of the "directories" directly under the prefix."""
    names = []
    paginator = client().get_paginator("list_objects_v2")
    for page in paginator.paginate(Bucket=location.bucket, Prefix=location.prefix, Delimiter="/"):
        for common in page.get("CommonPrefixes", []):
            names.append(common["Prefix"][len(location.prefix):].rstrip("/"))
    return names


def download_file(location: S3Location, target: Path, modified_ns: int | None = None,
                  size: int | None = None) -> None:
    """Fetch one object; with modified_ns, the file's mtime is set to it before the file appears.
    With its listed SIZE up to SINGLE_GET_MAX, one GET into memory: the transfer manager asks for
    the size first and costs milliseconds of CPU a file, which 4,000 caption files NAME.txt made
    most of the time before a streamed set's first step."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".part")
    if size is not None and size <= SINGLE_GET_MAX:
        partial.write_bytes(client().get_object(Bucket=location.bucket, Key=location.key)["Body"].read())
    else:
        client().download_file(location.bucket, location.key, str(partial), Config=_transfer_config())
    if modified_ns is not None:
        os.utime(partial, ns=(modified_ns, modified_ns))
    partial.replace(target)


def upload_file(source: Path, location: S3Location) -> None:
    client().upload_file(str(source), location.bucket, location.key, Config=_transfer_config())


def download_prefix(location: S3Location, target: Path) -> list[Path]:
    """Mirror a prefix into a directory, as `aws s3 sync` does: each file takes its object's
    LastModified as its mtime, and one already there with the object's size and time is kept.

    The times make a mirror the same on every node and after every re-fetch (an encoder's cache
    identity reads them), and a re-uploaded model of the same size (new weights, same shapes) is
    fetched again rather than kept stale."""
    objects = list_stored_objects(location)
    if not objects:
        raise FileNotFoundError(f"{location.uri} is empty or does not exist")
    # Keys are chosen by whoever writes to the bucket: each must land inside target.
    files = {name: confined(target, name, f"object key under {location.uri}")
             for name in objects if not name.endswith("/")}
    wanted = [name for name, path in files.items() if not mirrors(path, objects[name])]
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        list(pool.map(lambda name: download_file(location.child(name), files[name], objects[name].modified_ns,
                                                 objects[name].size), wanted))
    log.info("fetched %d of %d files from %s", len(wanted), len(objects), location.uri)
    return list(files.values())


def mirrors(path: Path, stored: StoredObject) -> bool:
    """Whether PATH is a download of the object as it is now (its size and, set at download, its time)."""
    if not path.is_file():
        return False
    stat = path.stat()
    return stat.st_size == stored.size and stat.st_mtime_ns == stored.modified_ns


def upload_files(files: list[Path], root: Path, location: S3Location) -> None:
    """Upload files (paths under root) to the same relative keys, in parallel."""
    with ThreadPoolExecutor(PARALLEL_FILES) as pool:
        list(pool.map(lambda f: upload_file(f, location.child(str(f.relative_to(root)))), files))


def delete_object(location: S3Location) -> None:
    client().delete_object(Bucket=location.bucket, Key=location.key)


def delete_prefix(location: S3Location) -> None:
    keys = [location.prefix + name for name in list_objects(location)]
    for start in range(0, len(keys), 1000):
        client().delete_objects(Bucket=location.bucket,
                                Delete={"Objects": [{"Key": k} for k in keys[start:start + 1000]], "Quiet": True})


def read_text(location: S3Location) -> str | None:
    """A small object's text; None when there is no such object."""
    from botocore.exceptions import ClientError

    try:
        response = client().get_object(Bucket=location.bucket, Key=location.key)
    except ClientError as err:
        if err.response.get("Error", {}).get("Code") in ("NoSuchKey", "404"):
            return None
        raise
    return response["Body"].read().decode()


def write_text(location: S3Location, text: str) -> None:
    client().put_object(Bucket=location.bucket, Key=location.key, Body=text.encode())


def write_text_if_absent(location: S3Location, text: str) -> bool:
    """Create a small object only if no object has its key (a conditional put, If-None-Match: *,
    which AWS S3, MinIO and versitygw honour atomically): True if this call created it, False if
    another writer's was there first. What makes one writer among many pods."""
    from botocore.exceptions import ClientError

    try:
        client().put_object(Bucket=location.bucket, Key=location.key, Body=text.encode(), IfNoneMatch="*")
    except ClientError as err:
        if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") in (409, 412):
            return False  # 412 PreconditionFailed; 409 ConditionalRequestConflict (a concurrent create)
        raise
    return True


def object_age_seconds(location: S3Location) -> float | None:
    """Seconds since the object was last written (by the server's clock); None if it is absent."""
    from botocore.exceptions import ClientError

    try:
        head = client().head_object(Bucket=location.bucket, Key=location.key)
    except ClientError as err:
        if err.response.get("ResponseMetadata", {}).get("HTTPStatusCode") == 404:
            return None
        raise
    written = head["LastModified"]  # a header's date (RFC 1123) left as text by our parser settings
    if isinstance(written, str):
        from email.utils import parsedate_to_datetime

        written = parsedate_to_datetime(written)
    return (datetime.now(timezone.utc) - written).total_seconds()
