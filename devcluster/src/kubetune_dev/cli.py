"""Click commands that `kubetune dev` gains from the local control plane.

`kubetune_cli.main` adds every command in COMMANDS to its `dev` group.
"""
from __future__ import annotations

import shlex
import sys
import time
from pathlib import Path

import click

from kubetune_dev.cluster import Cluster, NotReady, rss_bytes, tree
from kubetune_dev.versions import MissingBinary

_HOME = click.option("--home", type=click.Path(file_okay=False, path_type=Path), default=None,
                     help="State directory [default: $KUBETUNE_DEV_HOME or ~/.kubetune/dev].")


@click.command()
@_HOME
def up(home: Path | None) -> None:
    """Start the local control plane (idempotent: starts only what is not running)."""
    start = time.monotonic()
    cluster = Cluster(home)
    try:
        cluster.up()
    except (MissingBinary, NotReady) as e:
        raise click.ClickException(str(e)) from None
    click.echo(f"control plane ready in {time.monotonic() - start:.1f} s; "
               f"use it with: eval \"$(kubetune dev env{f' --home {cluster.home}' if home else ''})\"")


@click.command()
@_HOME
@click.option("--purge", is_flag=True, help="Also delete the state directory (etcd data, certificates, logs).")
def down(home: Path | None, purge: bool) -> None:
    """Stop every process of the control plane, pods included."""
    cluster = Cluster(home)
    cluster.down()
    if purge:
        import shutil

        shutil.rmtree(cluster.home, ignore_errors=True)
        click.echo(f"removed {cluster.home}")


@click.command()
@_HOME
def status(home: Path | None) -> None:
    """Show which components run and their resident memory (exit status 1 when any is stopped)."""
    cluster = Cluster(home)
    states = cluster.status()
    pods = cluster.pod_pids()
    for name, pid in states.items():
        if pid:
            click.echo(f"{name:24} running (pid {pid}, RSS {rss_bytes(tree(pid) - pods) / 2**20:.0f} MiB)")
        else:
            click.echo(f"{name:24} stopped")
    click.echo(f"{'pods':24} {len(pods)} processes, RSS {rss_bytes(pods) / 2**20:.0f} MiB")
    click.echo(f"{'total':24} RSS {rss_bytes(cluster.pids()) / 2**20:.0f} MiB")
    if not all(states.values()):
        sys.exit(1)


@click.command()
@_HOME
def env(home: Path | None) -> None:
    """Print shell exports for kubectl, helm, boto3 and Prometheus: eval "$(kubetune dev env)"."""
    try:
        exports = Cluster(home).env()
    except MissingBinary as e:
        raise click.ClickException(str(e)) from None
    for key, value in exports.items():
        click.echo(f"export {key}={shlex.quote(value)}")


@click.command()
@_HOME
@click.argument("pod")
@click.option("-n", "--namespace", default="default", show_default=True)
@click.option("-c", "--container", default=None, help="Container name (needed when the pod has several).")
@click.option("-f", "--follow", is_flag=True, help="Keep printing as the log grows.")
def logs(home: Path | None, pod: str, namespace: str, container: str | None, follow: bool) -> None:
    """Print a pod container's log (or a component's, e.g. `logs kube-apiserver`)."""
    try:
        path = Cluster(home).pod_log(pod, namespace, container)
    except FileNotFoundError as e:
        raise click.ClickException(str(e)) from None
    with open(path, "rb") as f:
        while True:
            chunk = f.read()
            if chunk:
                sys.stdout.buffer.write(chunk)
                sys.stdout.flush()
            elif not follow:
                return
            else:
                time.sleep(0.5)


COMMANDS: list[click.Command] = [up, down, status, env, logs]
