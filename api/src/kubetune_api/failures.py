"""The one table from an exception to what the user reads and the exit code (the `kubetune` CLI
and the trainer's entry both ask it), so a storage, model or file error reaches the user as one
line naming what to fix, never as a traceback.

Rows are matched by class *name* along the exception's MRO (`botocore.exceptions.ClientError`),
so this module imports neither boto nor torch: `kubetune validate` stays light, and a library's
new subclass of a known error (botocore has dozens) is answered by its parent's row.
"""
from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Callable

from kubetune_api.contract import EXIT_BAD_INPUT

BAD_INPUT = EXIT_BAD_INPUT  # the input is wrong: retrying as it is cannot help
FAILED = 1  # the environment failed (a store unreachable, a disk full): fix it and retry
INTERRUPTED = 130  # Ctrl-C

# Out of room: the disk, the quota, or the process's file-size limit.
DISK_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)


@dataclass(frozen=True)
class Answer:
    code: int
    message: str  # one line


def disk_full(error: BaseException) -> bool:
    """An OSError for lack of room, or a library's wrapper of one (safetensors says "(os error 28)")."""
    if isinstance(error, OSError) and error.errno in DISK_FULL:
        return True
    return any(f"(os error {code})" in str(error) for code in DISK_FULL)


def one_line(text: object, limit: int = 400) -> str:
    flat = " ".join(str(text).split())
    return flat if len(flat) <= limit else flat[:limit - 3] + "..."


def _s3_client_error(err: BaseException) -> Answer:
    """botocore's ClientError: S3 answered, and said no."""
    details = getattr(err, "response", {}).get("Error", {})
    code = str(details.get("Code", ""))
    bucket = details.get("BucketName")
    if code in ("NoSuchBucket", "404") and bucket:
        return Answer(FAILED, f"S3 bucket {bucket!r} does not exist at this endpoint: check the bucket name in the "
                              "URI (and AWS_ENDPOINT_URL / spec.s3.endpointUrl), or create the bucket")
    if code == "NoSuchBucket":
        return Answer(FAILED, f"the S3 bucket does not exist ({one_line(err)}): check the bucket name in the URI, "
                              "or create the bucket")
    if code in ("AccessDenied", "403", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"):
        return Answer(FAILED, f"S3 refused the credentials ({code}): check the AWS credentials of this shell "
                              "(or spec.s3.credentialsSecret on the cluster)")
    return Answer(FAILED, f"S3 error ({one_line(err)}): check the URI, AWS_ENDPOINT_URL and the credentials")


def _s3_unreachable(err: BaseException) -> Answer:
    return Answer(FAILED, f"cannot reach the S3 endpoint ({one_line(err)}): check AWS_ENDPOINT_URL (or "
                          "spec.s3.endpointUrl) and that the store is up")


def _s3_no_credentials(err: BaseException) -> Answer:
    return Answer(FAILED, "no S3 credentials found: set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE "
                          "in this shell (spec.s3.credentialsSecret on the cluster)")


def _s3_bad_name(err: BaseException) -> Answer:
    return Answer(BAD_INPUT, f"not a valid S3 bucket or key ({one_line(err)}): S3 bucket names are 3-63 "
                             "lowercase letters, digits, dots and hyphens")


def _no_room(err: BaseException) -> Answer:
    where = getattr(err, "filename", None) or "a file"
    return Answer(FAILED, f"cannot write {where}: no room left ({one_line(err)}); free space on that disk, or point "
                          "spec.checkpoints.uri (and KUBETUNE_STAGING_DIR for s3:// runs) at a larger one")


def _os_error(err: BaseException) -> Answer:
    where = getattr(err, "filename", None)
    reason = getattr(err, "strerror", None) or one_line(err)
    if isinstance(err, (FileNotFoundError, NotADirectoryError, IsADirectoryError)):
        return Answer(BAD_INPUT, f"{where or 'a file'}: {reason}: check the path")
    if isinstance(err, PermissionError):
        return Answer(FAILED, f"{where or 'a file'}: {reason}: check its permissions")
    return Answer(FAILED, f"{where + ': ' if where else ''}{reason}")


def _own_message(code: int) -> Callable[[BaseException], Answer]:
    """Errors whose text was written for the user already (they name the field or the file)."""
    return lambda err: Answer(code, one_line(err, 2000))


def _interrupted(err: BaseException) -> Answer:
    return Answer(INTERRUPTED, "interrupted")


def _too_deep(err: BaseException) -> Answer:
    return Answer(BAD_INPUT, "the input is nested too deeply to read (a RecursionError): simplify it")


def _out_of_memory(err: BaseException) -> Answer:
    return Answer(FAILED, "out of memory: the input asked for more than this machine has")


# Most specific first: the first row naming a class along the exception's MRO answers.
TABLE: dict[str, Callable[[BaseException], Answer]] = {
    # Ours: their messages are written for the user.
    "kubetune_api.manifest.ManifestError": _own_message(BAD_INPUT),
    "kubetune_trainer.errors.ConfigError": _own_message(BAD_INPUT),
    "kubetune_trainer.storage.confine.UnsafePath": _own_message(BAD_INPUT),
    "kubetune_trainer.checkpoint.catalog.DestinationTaken": _own_message(BAD_INPUT),
    "kubetune_trainer.checkpoint.catalog.PullFailed": _own_message(FAILED),
    # S3 (botocore), by what went wrong rather than by which of botocore's classes said it.
    "botocore.exceptions.NoCredentialsError": _s3_no_credentials,
    "botocore.exceptions.PartialCredentialsError": _s3_no_credentials,
    "botocore.exceptions.EndpointConnectionError": _s3_unreachable,
    "botocore.exceptions.ConnectTimeoutError": _s3_unreachable,
    "botocore.exceptions.ReadTimeoutError": _s3_unreachable,
    "botocore.exceptions.ConnectionError": _s3_unreachable,
    "botocore.exceptions.HTTPClientError": _s3_unreachable,
    "botocore.exceptions.InvalidEndpointConfigurationError": _s3_unreachable,
    "botocore.exceptions.ParamValidationError": _s3_bad_name,
    "botocore.exceptions.ClientError": _s3_client_error,
    "botocore.exceptions.BotoCoreError": lambda err: Answer(FAILED, f"S3 error ({one_line(err)}): check the URI, "
                                                                    "AWS_ENDPOINT_URL and the credentials"),
    "builtins.KeyboardInterrupt": _interrupted,
    "builtins.RecursionError": _too_deep,
    "builtins.MemoryError": _out_of_memory,
    "builtins.OSError": _os_error,
}


def qualified_names(error: BaseException) -> list[str]:
    return [f"{cls.__module__}.{cls.__qualname__}" for cls in type(error).__mro__]


def answer(error: BaseException) -> Answer | None:
    """The table's answer to error, or None when no row knows it (a bug: its caller decides)."""
    if disk_full(error):  # whoever wrapped it (safetensors says "(os error 28)")
        return _no_room(error)
    for name in qualified_names(error):
        row = TABLE.get(name)
        if row is not None:
            return row(error)
    return None


def answer_unexpected(error: BaseException) -> Answer:
    """What the user reads about an error no row knows: still one line, naming it as a bug."""
    return Answer(FAILED, f"unexpected {type(error).__name__}: {one_line(error)} (a kubetune bug: please report it; "
                          "KUBETUNE_TRACEBACK=1 shows where it happened)")
