"""Which job's runs a command means, and reading them: JOB is a TrainingJob name (looked up through the
cluster of the current kubeconfig: its spec.checkpoints.uri, and status.outputUri for the run in
progress) or a URI — s3://... or a local path — of a job directory (<uri>/<namespace>/<job>) or of one
run (.../v<N>). Shared by `kubetune checkpoints`, generate, evaluate, export and report; S3 is reached
with the usual AWS settings of this shell (AWS_ENDPOINT_URL, AWS_PROFILE, ...).
"""
from __future__ import annotations

import datetime
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import click

from kubetune_api import layout
from kubetune_api.failures import BAD_INPUT, FAILED

STEP_HELP = "A checkpoint's step, the newest complete one, or the run's final weights."


@dataclass(frozen=True)
class Target:
    uri: str  # a job directory or a run directory
    current: str | None = None  # the run the TrainingJob is on now (status.outputUri)
    described: str = ""
    namespace: str | None = None  # a TrainingJob's namespace, when JOB named one on the cluster


def fail(message: str, code: int = BAD_INPUT) -> None:
    """One line on stderr, prefixed with the command it came from (checkpoints, generate, export...:
    they all find runs through this module), and exit with `code`: 2 for what the user asked wrong,
    1 where the environment failed (kubetune_api.failures)."""
    click.echo(f"kubetune {top_level_command()}: {message}", err=True)
    sys.exit(code)


def top_level_command() -> str:
    context = click.get_current_context(silent=True)
    while context is not None and context.parent is not None and context.parent.parent is not None:
        context = context.parent
    return context.info_name if context is not None and context.parent is not None else "checkpoints"


def is_uri(job: str) -> bool:
    return job.startswith("s3://") or "/" in job or Path(job).exists()


def from_cluster(name: str, namespace: str | None) -> Target:
    from kubernetes import client, config
    from kubernetes.client.exceptions import ApiException

    try:
        if namespace is None:
            _, active = config.list_kube_config_contexts()
            namespace = active.get("context", {}).get("namespace") or "default"
        api = client.CustomObjectsApi(config.new_client_from_config())
    except (config.ConfigException, OSError) as err:
        fail(f"no cluster to ask for TrainingJob {name!r} ({err}); pass its s3:// URI instead", FAILED)
    try:
        job = api.get_namespaced_custom_object("kubetune.dev", "v1alpha1", namespace, "trainingjobs", name)
    except ApiException as err:
        if err.status == 404:
            fail(f"no TrainingJob {name!r} in namespace {namespace!r} (use -n NAMESPACE, or pass an s3:// URI)")
        raise
    job_uri = layout.job_root(job["spec"]["checkpoints"]["uri"], namespace, name)
    return Target(job_uri, (job.get("status") or {}).get("outputUri"), f"TrainingJob {namespace}/{name}", namespace)


def resolve(job: str, namespace: str | None) -> Target:
    if is_uri(job):
        return Target(job.rstrip("/"), described=job)
    return from_cluster(job, namespace)


def when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    return datetime.datetime.fromtimestamp(timestamp, datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S")


@contextmanager
def storage_errors(uri: str):
    """S3 trouble (no credentials, no bucket, endpoint down) or a download that cannot be trusted, as
    one line naming the URI."""
    from botocore.exceptions import BotoCoreError, ClientError

    from kubetune_api.failures import answer
    from kubetune_trainer.checkpoint.catalog import DestinationTaken, PullFailed
    from kubetune_trainer.storage.confine import UnsafePath

    try:
        yield
    except (BotoCoreError, ClientError) as err:
        found = answer(err)  # the one table's words for it, and its exit code
        fail(f"cannot read {uri}: {found.message}", found.code)
    except (DestinationTaken, UnsafePath) as err:  # what the user asked for would overwrite or escape
        fail(str(err))
    except PullFailed as err:  # what the store holds did not arrive intact
        fail(str(err), FAILED)


def load_runs(target: Target):
    from kubetune_trainer.checkpoint.catalog import describe

    with storage_errors(target.uri):
        found = describe(target.uri)
    if not found:
        fail(f"no runs under {target.uri} ({target.described}): nothing was written there yet")
    return found


namespace_option = click.option("-n", "--namespace", default=None,
                                help="Namespace of the TrainingJob (default: the kubeconfig context's).")
version_option = click.option("--version", "version", type=int, default=None,
                              help="Which run (v<N>); default: the TrainingJob's current run, else the newest.")
