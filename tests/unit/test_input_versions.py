"""What names an input the same on every node: storage.inputs.origin and version_of."""
from __future__ import annotations

import os
import shutil

from kubetune_trainer.storage.inputs import mirrors_root, origin, version_of


def test_a_mirror_is_named_by_the_uri_it_mirrors_wherever_the_nodes_cache_lies(tmp_path, monkeypatch):
    for node in ("node-0", "node-1"):
        monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / node))
        assert origin(str(mirrors_root() / "models" / "sd15" / "unet")) == "s3://models/sd15/unet"
    assert origin("/data/models/sd15") == "/data/models/sd15", "a local path names itself"
    assert origin("org/name") == "org/name"


def test_a_version_follows_the_files_not_the_folder_they_lie_in(tmp_path, monkeypatch):
    first = tmp_path / "node-0" / "s3" / "models" / "sd15"
    (first / "vae").mkdir(parents=True)
    (first / "vae" / "weights.safetensors").write_bytes(b"w" * 64)
    (first / "model_index.json").write_text("{}")
    second = tmp_path / "node-1" / "s3" / "models" / "sd15"
    shutil.copytree(first, second)  # times kept, as each node's mirror of the same objects

    def version_on(node: str, folder) -> str | None:
        monkeypatch.setenv("KUBETUNE_CACHE_DIR", str(tmp_path / node))
        return version_of(str(folder))

    assert version_on("node-0", first) == version_on("node-1", second)
    weights = second / "vae" / "weights.safetensors"
    weights.write_bytes(b"W" * 64)  # another upload: same size, a later time
    os.utime(weights, ns=(weights.stat().st_mtime_ns + 10**9,) * 2)
    assert version_on("node-0", first) != version_on("node-1", second)
    assert version_of("org/name") is None, "a hub id: not a local folder"
