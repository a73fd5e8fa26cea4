"""Where a spec's inputs and outputs live: a local path or an s3:// URI (StorageUri), a checkpoint to resume
from (ResumeSource), each checked the same way in Python and, for the API server, in CEL."""
from __future__ import annotations

import re
from typing import Annotated

from pydantic import AfterValidator, Field


# URI schemes the storage layer understands; a bare path (no scheme) is a local path.
SUPPORTED_URI_SCHEMES = ("s3",)

_SCHEME_WITHOUT_SLASHES = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(?!//)")
# S3's bucket naming rules (the virtual-host-safe form every S3 implementation accepts).
_S3_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
# Characters a user writes meaning something else than a key character (a URL query, a fragment,
# a Windows path, a percent-escape), or that no tool shows faithfully.
_KEY_CHARACTERS_REFUSED = set("?#\\%")


def check_storage_uri(value: str) -> str:
    """Accept a local path or s3://bucket[/prefix]; name the supported forms otherwise."""
    if "://" not in value:
        if _SCHEME_WITHOUT_SLASHES.match(value):  # s3:/bucket/x would silently be a local directory
            scheme = value.split(":", 1)[0]
            raise ValueError(f"{value!r} looks like a {scheme}: URI without its two slashes; write "
                             f"{scheme}://bucket/prefix, or ./{value} for a local path")
        return value
    scheme, rest = value.split("://", 1)
    if scheme not in SUPPORTED_URI_SCHEMES:
        raise ValueError(
            f"unsupported URI scheme {scheme!r}; use a local path or s3://bucket/prefix"
        )
    if not rest or rest.startswith("/"):
        raise ValueError("an s3 URI needs a bucket: s3://bucket/prefix")
    bucket, _, prefix = rest.partition("/")
    if not _S3_BUCKET.fullmatch(bucket):
        raise ValueError(f"{bucket!r} is not an S3 bucket name: 3-63 lowercase letters, digits, dots and hyphens, "
                         "starting and ending with a letter or digit")
    odd = sorted({c for c in prefix if c in _KEY_CHARACTERS_REFUSED or not c.isprintable()})
    if odd:
        raise ValueError(f"the key prefix {prefix!r} contains {', '.join(repr(c) for c in odd)}; S3 would take "
                         "them literally (no query, fragment or escape): use letters, digits and / - _ . only")
    segments = prefix.rstrip("/").split("/") if prefix else []
    if any(segment in ("", ".", "..") for segment in segments):
        raise ValueError(f"the key prefix {prefix!r} has an empty, '.' or '..' segment; S3 keeps them as written, "
                         "so the same run would have two names (and '..' climbs out locally): write s3://bucket/a/b")
    return value


# The same rule for the API server, in CEL (check_storage_uri is the Python side, which also
# refuses control characters).
_STORAGE_URI_RULE = ("self.contains('://') ? (self.matches('^s3://[a-z0-9][a-z0-9.-]{1,61}[a-z0-9](/|$)') && "
                     "!self.matches('^s3://[^/]+/(.*/)?\\\\.{1,2}(/|$)') && !self.matches('^s3://.*//') && "
                     "!self.matches('[?#%\\\\\\\\]')) "
                     ": !self.matches('^[A-Za-z][A-Za-z0-9+.-]*:')")
_STORAGE_URI_FORMS = "two slashes, an S3 bucket name, no '.', '..' or empty key segments, no ? # % or backslash"

StorageUri = Annotated[str, AfterValidator(check_storage_uri), Field(
    min_length=1, max_length=2048,
    json_schema_extra={"x-kubernetes-validations": [{
        "rule": _STORAGE_URI_RULE,
        "message": f"unsupported URI; use a local path or s3://bucket/prefix ({_STORAGE_URI_FORMS})",
    }]},
)]


def check_resume_source(value: str) -> str:
    if value != "latest":
        try:
            check_storage_uri(value)
        except ValueError as err:
            raise ValueError(f"use latest or a checkpoint URI (s3://bucket/prefix/ns/job/v0/checkpoint-500): {err}")
    return value


ResumeSource = Annotated[str, AfterValidator(check_resume_source), Field(
    min_length=1, max_length=2048,
    json_schema_extra={"x-kubernetes-validations": [{
        "rule": f"self == 'latest' || ({_STORAGE_URI_RULE})",
        "message": "use latest or a checkpoint URI (a local path or s3://bucket/prefix/ns/job/v0/checkpoint-500; "
                   f"{_STORAGE_URI_FORMS})",
    }]},
)]
