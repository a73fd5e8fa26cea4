"""Click commands that `kubetune dev` gains from the local control plane.

`kubetune_cli.main` adds every command in COMMANDS to its `dev` group.
"""
import click

COMMANDS: list[click.Command] = []
