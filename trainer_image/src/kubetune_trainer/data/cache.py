"""A cache of encoder outputs (VAE latents, text embeddings) keyed by content, never by position.

The key of one sample's entry is a hash of the encoder's identity (weights, config, precision)
and of exactly what the encoder reads (the transformed pixels, the caption after dropout). A
reshuffle, another process count, another run or a changed caption therefore can never pair a
latent with the wrong text: different input, different key. Entries are one safetensors file
each, written atomically, so every rank and every run can share one cache directory (or prefix).
"""
from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors.torch import load, save

from kubetune_trainer.storage.inputs import version_of

log = logging.getLogger(__name__)
Encoded = dict[str, torch.Tensor]


@dataclass(frozen=True)
class Encoder:
    """A frozen encoder: `encode` turns a list of per-sample inputs into batch-first tensors."""

    name: str
    identity: str  # changes whenever the outputs would (see model_identity)
    encode: Callable[[list[Any]], Encoded]


def model_identity(model: torch.nn.Module, source: str, dtype: torch.dtype, extra: str = "") -> str:
    """The version of the weights' folder (storage.inputs.version_of: the same on every node that
    holds the same files, an s3:// mirror named by its URI), else the hub id; the config and the
    precision."""
    config = getattr(model, "config", None)
    settings = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
    settings.pop("_name_or_path", None)  # the directory this node loaded it from: the version names it
    config_text = json.dumps(settings, sort_keys=True, default=str)
    return json.dumps([version_of(source) or source, config_text, str(dtype), type(model).__name__, extra])


def content_hash(value: Any) -> bytes:
    """A stable digest of a tensor, string, number or nested tuple/list of them."""
    digest = hashlib.sha256()

    def feed(item: Any) -> None:
        if isinstance(item, torch.Tensor):
            tensor = item.detach().cpu().contiguous()
            digest.update(f"T{tensor.dtype}{tuple(tensor.shape)}".encode())
            if tensor.numel():
                digest.update(tensor.reshape(-1).view(torch.uint8).numpy())  # the buffer itself: no copy
        elif isinstance(item, (list, tuple)):
            digest.update(f"L{len(item)}".encode())
            for part in item:
                feed(part)
        else:
            digest.update(f"{type(item).__name__}:{item!r}".encode())

    feed(value)
    return digest.digest()


class Store(Protocol):
    def get(self, key: str) -> bytes | None: ...
    def put(self, key: str, data: bytes) -> None: ...
    def contains(self, key: str) -> bool: ...


class LocalStore:
    """A directory, e.g. on a volume all pods mount; writes are atomic renames."""

    def __init__(self, root: Path):
        self.root = root

    def _path(self, key: str) -> Path:
        return self.root / key[:2] / f"{key}.safetensors"

    def get(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def contains(self, key: str) -> bool:
        return self._path(key).is_file()

    def put(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        handle, partial = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(handle, "wb") as out:
            out.write(data)
        os.replace(partial, path)


class S3Store:
    """An s3://bucket/prefix; objects appear whole, so concurrent writers of one key are harmless."""

    def __init__(self, uri: str, client):
        self.bucket, _, prefix = uri[len("s3://"):].partition("/")
        self.prefix = prefix.strip("/")
        self.client = client

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key[:2]}/{key}.safetensors".lstrip("/")

    def get(self, key: str) -> bytes | None:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"].read()
        except self.client.exceptions.NoSuchKey:
            return None

    def contains(self, key: str) -> bool:
        from botocore.exceptions import ClientError

        try:
            self.client.head_object(Bucket=self.bucket, Key=self._key(key))
            return True
        except ClientError as err:
            if err.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
                return False
            raise

    def put(self, key: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=io.BytesIO(data))


class EmbeddingCache:
    """Looks each sample up; encodes the misses of a batch together; stores them one per sample."""

    def __init__(self, store: Store):
        self.store = store
        self.hits = 0
        self.misses = 0
        self._stored: set[str] = set()  # keys this process knows are in the store
        # Keys whose tensor variants (an image's mirror: a function of the image) this process has
        # seen stored: their variants are neither hashed nor looked up again (a step's main cost).
        self._variants_stored: set[str] = set()

    def encode(self, encoder: Encoder, inputs: list[Any], variants: list[list[Any]] | None = None) -> Encoded:
        """The encodings of `inputs`, from the store where they are there. A missing input is encoded
        together with its `variants[i]` (the other forms augmentation may draw for that sample: its
        mirror image, its caption dropped or not), which are stored too, so a later epoch that
        draws a variant finds it."""
        identity = hashlib.sha256(encoder.identity.encode()).digest()

        def key(item: Any) -> str:
            return hashlib.sha256(identity + content_hash(item)).hexdigest()

        keys = [key(item) for item in inputs]
        found = [self._load(k) for k in keys]
        missing = [i for i, entry in enumerate(found) if entry is None]
        self.hits += len(inputs) - len(missing)
        self.misses += len(missing)
        # Variants of every input, hit or not: a hit may have been stored by another sample or run
        # that never drew this sample's other forms.
        absent = {}
        settled = []  # inputs whose variants are all tensors, and so the same whenever the input is
        for input_key, forms in zip(keys, variants or []):
            if input_key in self._variants_stored:
                continue
            for variant in forms:
                variant_key = key(variant)
                if variant_key not in absent and variant_key not in keys and not self._has(variant_key):
                    absent[variant_key] = variant
            if all(isinstance(form, torch.Tensor) for form in forms):
                settled.append(input_key)
        batch = [inputs[i] for i in missing] + list(absent.values())
        if batch:
            fresh = encoder.encode(batch)
            for row, item in enumerate(batch):
                entry = {name: tensor[row].detach().cpu().contiguous() for name, tensor in fresh.items()}
                self._put(key(item), entry)
                if row < len(missing):
                    found[missing[row]] = entry
        self._variants_stored.update(settled)  # stored now, or found there
        return {name: stack_padded([entry[name] for entry in found]) for name in found[0]}

    def _has(self, key: str) -> bool:
        if key not in self._stored and self.store.contains(key):
            self._stored.add(key)
        return key in self._stored

    def _put(self, key: str, entry: Encoded) -> None:
        self.store.put(key, save(entry))
        self._stored.add(key)

    def _load(self, key: str) -> Encoded | None:
        data = self.store.get(key)
        if data is None:
            return None
        self._stored.add(key)
        return load(data)


def stack_padded(rows: list[torch.Tensor]) -> torch.Tensor:
    """Stack per-sample rows; ragged first dimensions (token sequences encoded in batches of other
    lengths) are zero-padded to the longest, as the encoders pad their own batches."""
    if rows[0].dim() == 0 or len({row.shape[0] for row in rows}) == 1:
        return torch.stack(rows)
    longest = max(row.shape[0] for row in rows)
    return torch.stack([torch.cat([row, row.new_zeros(longest - row.shape[0], *row.shape[1:])]) for row in rows])


def open_store(uri: str) -> Store:
    if not uri.startswith("s3://"):
        return LocalStore(Path(uri))
    from kubetune_trainer.storage import s3

    return S3Store(uri, s3.client())
