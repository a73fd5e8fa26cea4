"""A directory of runs, read and written the same way whether it is a local path or s3://.

Run versions (checkpoint/runs.py) and the `kubetune checkpoints` commands only need to list a
level, read and write a small file and delete a subtree; this is that much, twice.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from kubetune_trainer.storage import s3
from kubetune_trainer.storage.confine import confined
from kubetune_trainer.storage.uri import S3Location, is_s3, parse_s3


class LocalTree:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.uri = str(self.root)

    def child(self, *parts: str) -> "LocalTree":
        return LocalTree(self.root.joinpath(*parts))

    def children(self) -> list[str]:
        """Names of the subdirectories."""
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def files(self) -> dict[str, int]:
        """Every file below, by relative path, with its size."""
        if not self.root.is_dir():
            return {}
        return {str(p.relative_to(self.root)): p.stat().st_size for p in self.root.rglob("*") if p.is_file()}

    def read_text(self, name: str) -> str | None:
        path = self.root / name
        return path.read_text() if path.is_file() else None

    def write_text(self, name: str, text: str) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(path.name + ".tmp")
        partial.write_text(text)
        partial.replace(path)  # readers see the old or the new file, never half of one

    def delete(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    def download(self, target: Path) -> Path:
        """A local directory holding the tree's files (this one: no copy needed)."""
        return self.root

    def fetch(self, names: list[str], target: Path) -> list[Path]:
        """Copies of some files (relative paths) under target; a name may not leave either root."""
        copies = []
        for name in names:
            source = confined(self.root, name, f"file in {self.root}")
            copy = confined(target, name, "file name")
            copy.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, copy)
            copies.append(copy)
        return copies


class S3Tree:
    def __init__(self, location: S3Location):
        self.location = location
        self.uri = location.uri

    def child(self, *parts: str) -> "S3Tree":
        return S3Tree(self.location.child(*parts))

    def children(self) -> list[str]:
        return sorted(s3.list_children(self.location))

    def files(self) -> dict[str, int]:
        return s3.list_objects(self.location)

    def read_text(self, name: str) -> str | None:
        return s3.read_text(self.location.child(name))

    def write_text(self, name: str, text: str) -> None:
        s3.write_text(self.location.child(name), text)  # one PUT: S3 never shows half an object

    def delete(self) -> None:
        s3.delete_prefix(self.location)

    def download(self, target: Path) -> Path:
        s3.download_prefix(self.location, target)
        return target

    def fetch(self, names: list[str], target: Path) -> list[Path]:
        copies = [confined(target, name, f"object key under {self.uri}") for name in names]
        for name, copy in zip(names, copies):
            s3.download_file(self.location.child(name), copy)
        return copies


def open_tree(uri: str) -> LocalTree | S3Tree:
    return S3Tree(parse_s3(uri)) if is_s3(uri) else LocalTree(Path(uri))
