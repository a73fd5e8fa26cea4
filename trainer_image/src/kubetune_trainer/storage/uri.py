"""Parsing and joining storage URIs (pure functions)."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class S3Location:
    bucket: str
    key: str  # no leading slash; "" for the bucket root

    @property
    def uri(self) -> str:
        return f"s3://{self.bucket}/{self.key}" if self.key else f"s3://{self.bucket}"

    def child(self, *parts: str) -> "S3Location":
        tail = "/".join(p.strip("/") for p in parts if p.strip("/"))
        key = f"{self.key.rstrip('/')}/{tail}" if self.key else tail
        return S3Location(self.bucket, key.strip("/"))

    @property
    def prefix(self) -> str:
        """The key as a directory prefix ("" or ending in /)."""
        return f"{self.key.rstrip('/')}/" if self.key else ""


def is_s3(uri: str) -> bool:
    return uri.startswith("s3://")


def parse_s3(uri: str) -> S3Location:
    if not is_s3(uri):
        raise ValueError(f"not an s3:// URI: {uri!r}")
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not bucket:
        raise ValueError(f"an s3 URI needs a bucket: {uri!r}")
    return S3Location(bucket, key.strip("/"))
