"""`kubetune models`: hub models mirrored into S3 ahead of time, from a workstation.

`kubetune models mirror ORG/NAME --revision R --to s3://bucket/prefix` does what the first pod of a
job would do (kubetune_trainer.storage.hub): pins R to its commit and copies the model's files into
<prefix>/hub/ORG/NAME/<commit>/ once, so that jobs naming that prefix as their mirror
(spec.model.mirrorUri or the chart's models.mirrorUri) never wait for the hub. The hub token is
HF_TOKEN of this shell (HF_ENDPOINT names another hub); S3 is reached with the usual AWS settings.
"""
from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import click

BAD_INPUT = 2


def fail(message: str) -> None:
    click.echo(f"kubetune models: {message}", err=True)
    sys.exit(BAD_INPUT)


@click.group()
def models() -> None:
    """Models from the Hugging Face Hub, mirrored into S3."""


@models.command("mirror")
@click.argument("model_id")
@click.option("--revision", default="main", show_default=True, help="A tag, branch or commit of the model.")
@click.option("--to", "to", required=True, metavar="s3://BUCKET/PREFIX",
              help="The mirror: the prefix jobs name in spec.model.mirrorUri or the chart's models.mirrorUri.")
def mirror(model_id: str, revision: str, to: str) -> None:
    """Copy MODEL_ID (org/name) at a revision from the hub into an S3 mirror, once."""
    import os

    from kubetune_api.hub import HubInput, looks_like_hub_id
    from kubetune_api.spec_uris import check_storage_uri
    from kubetune_trainer.errors import ConfigError, InputsInFlux
    from kubetune_trainer.storage import hub

    if not looks_like_hub_id(model_id):
        fail(f"MODEL_ID: {model_id!r} is not a hub id; write org/name (e.g. black-forest-labs/FLUX.1-Kontext-dev)")
    try:
        check_storage_uri(to)
    except ValueError as err:
        fail(f"--to: {err}")
    if not to.startswith("s3://"):
        fail(f"--to: {to!r} is not an s3:// prefix; write s3://bucket/prefix (every pod must reach the mirror)")
    item = HubInput("MODEL_ID", model_id, revision, "--revision")
    hint = "set HF_TOKEN in this shell to a token with access to it"
    try:
        commit = hub.resolve_commit(item, os.environ.get("HF_TOKEN") or None, hint)
        with tempfile.TemporaryDirectory(prefix="kubetune-mirror-") as staging:
            uri = hub.mirror(item, commit, to, os.environ.get("HF_TOKEN") or None, Path(staging), hint)
    except ConfigError as err:
        fail(str(err))
    except InputsInFlux as err:  # the hub out of reach
        click.echo(f"kubetune models: {err}", err=True)
        sys.exit(1)
    except Exception as err:  # S3 or network trouble: one line, not a traceback
        from botocore.exceptions import BotoCoreError, ClientError

        if not isinstance(err, (BotoCoreError, ClientError, OSError)):
            raise
        click.echo(f"kubetune models: cannot mirror {model_id}: {err} (check HF_ENDPOINT, AWS_ENDPOINT_URL and "
                   "the AWS credentials of this shell)", err=True)
        sys.exit(1)
    click.echo(f"{model_id}@{revision} (commit {commit}) is mirrored at {uri}")
