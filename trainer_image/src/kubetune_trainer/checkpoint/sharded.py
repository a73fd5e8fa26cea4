"""The trained state of a checkpoint, sharded: torch.distributed.checkpoint (DCP) under `state/`.

Model (trained parameters only), optimizer state and the EMA average are one DCP state dict.
Every process writes its own shards in parallel (`state/__<rank>_<n>.distcp`, and rank 0 the
`.metadata` index), so a sharded 20B model is never gathered on one GPU to be saved, and DCP
reshards on load, so the checkpoint resumes at any number of processes and under DDP or FSDP
alike (parameter names are the module's own, without wrapper prefixes).

Saving is asynchronous: the state is copied to CPU memory (training waits only for that copy),
then written by a background thread, which coordinates the ranks over a gloo process group of
its own so it never interleaves with training's collectives. The CPU copy goes into buffers kept
from the previous checkpoint (pinned on CUDA machines): allocating and first touching a whole
state's worth of fresh pages costs more than copying into it.
"""
from __future__ import annotations

import logging
import warnings
from concurrent.futures import Future
from pathlib import Path

import torch

from kubetune_trainer.errors import ConfigError

STATE_DIR = "state"
log = logging.getLogger("kubetune.trainer")
# One process without a process group is a normal case here, not a mistake to warn about.
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")


def _options(**kwargs):
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, **kwargs)


def raw_optimizer(optimizer):
    """The torch optimizer under Accelerate's wrapper."""
    return getattr(optimizer, "optimizer", optimizer)


def shard_files(checkpoint: Path, rank: int) -> list[Path]:
    """The files process `rank` wrote into its node's copy of the checkpoint's state/."""
    return sorted((checkpoint / STATE_DIR).glob(f"__{rank}_*.distcp"))


def files_of_rank(checkpoint: Path, rank: int, world_size: int) -> list[Path]:
    """What process `rank` contributes to a checkpoint on its node's disk: its shards and random
    state; rank 0 also everything written once (the DCP index, position, schedule, adapter)."""
    from kubetune_trainer.checkpoint.store import PARTS_DIR
    from kubetune_trainer.checkpoint.training_state import rng_file

    own = set(shard_files(checkpoint, rank)) | {checkpoint / rng_file(rank)}
    if rank != 0:
        return sorted(f for f in own if f.is_file())
    others = {f for r in range(1, world_size) for f in (*shard_files(checkpoint, r), checkpoint / rng_file(r))}
    every = {f for f in checkpoint.rglob("*") if f.is_file() and PARTS_DIR not in f.relative_to(checkpoint).parts}
    return sorted(every - others - {checkpoint / "manifest.json"})


def reused_buffers_stager():
    """A DCP stager that copies into the previous checkpoint's CPU buffers (new ones when the
    state's layout changed)."""
    from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict
    from torch.distributed.checkpoint.staging import BlockingAsyncStager

    class ReusedBuffersStager(BlockingAsyncStager):
        def stage(self, state_dict):
            if self.state_dict_cache is not None:
                try:
                    return _copy_state_dict(state_dict, self.state_dict_cache)
                except (KeyError, RuntimeError, ValueError):
                    self.state_dict_cache = None  # e.g. optimizer state that appeared since
            self.state_dict_cache = _create_cpu_state_dict(state_dict, pin_memory=torch.cuda.is_available())
            return _copy_state_dict(state_dict, self.state_dict_cache)

    return ReusedBuffersStager(cache_staged_state_dict=True)


class ShardedState:
    """Reads and writes the DCP part of checkpoints for one process."""

    def __init__(self, model: torch.nn.Module, optimizer, ema=None):
        import torch.distributed as dist

        self.model = model
        self.optimizer = raw_optimizer(optimizer)
        self.ema = ema
        self.distributed = dist.is_available() and dist.is_initialized()
        # Background saves talk over their own group: training's collectives never wait on them.
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.stager = reused_buffers_stager()
        self._saving: Future | None = None

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optimizer_state = get_state_dict(self.model, self.optimizer, options=_options())
        state = {"model": model_state, "optimizer": optimizer_state}
        if self.ema is not None:
            state["ema"] = self.ema.named_shadow()
        return state

    def save(self, checkpoint: Path) -> Future:
        """Start writing this process's shards; returns when they are copied to CPU memory."""
        import torch.distributed.checkpoint as dcp

        self.wait()  # one save at a time: the background thread's collectives come in order
        self._saving = dcp.async_save(self._state(), storage_writer=dcp.FileSystemWriter(checkpoint / STATE_DIR),
                                      process_group=self.group, async_stager=self.stager)
        return self._saving

    def wait(self) -> None:
        """Block until the save in flight (if any) has written everything."""
        if self._saving is not None:
            saving, self._saving = self._saving, None
            saving.result()

    def check_compatible(self, checkpoint: Path) -> None:
        """Refuse, naming what differs, a checkpoint whose trained parameters are not this model's."""
        expected = {name: tuple(shape) for name, shape in self.trained_shapes().items()}
        saved = saved_model_shapes(checkpoint)
        missing, unexpected = sorted(expected.keys() - saved.keys()), sorted(saved.keys() - expected.keys())
        reshaped = sorted(n for n in expected.keys() & saved.keys() if expected[n] != saved[n])
        if missing or unexpected or reshaped:
            raise ConfigError(
                f"checkpoint {checkpoint.name} does not match the model being trained (spec.adapter type, rank "
                f"or targetModules, or spec.model, changed?): {len(missing)} parameter(s) missing, e.g. "
                f"{missing[:2]}; {len(unexpected)} unexpected, e.g. {unexpected[:2]}; {len(reshaped)} of another "
                f"shape, e.g. {[(n, saved[n], expected[n]) for n in reshaped[:1]]}")

    def trained_shapes(self) -> dict[str, torch.Size]:
        """Global shapes of the trained parameters, by the names DCP saves them under."""
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {name: tensor.shape for name, tensor in
                get_model_state_dict(self.model, options=_options()).items()}

    def load(self, checkpoint: Path) -> None:
        """Put model, optimizer and EMA back from the checkpoint, resharded for this world."""
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, storage_reader=dcp.FileSystemReader(checkpoint / STATE_DIR), process_group=self.group)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optimizer"], options=_options(strict=False))
        if self.ema is not None:
            self.ema.load_named_shadow(state["ema"])


def damage(checkpoint: Path) -> str | None:
    """What is wrong with a checkpoint whose manifest verified, naming the file; None when it loads.

    The manifest's checksums catch a crash mid-save and damage after it. They cannot catch damage
    that someone sealed into a new manifest (a shard deleted, the DCP index truncated, the position
    emptied, then the manifest rewritten over what was left): this reads what resuming reads, without
    reading a tensor, so such a checkpoint is refused in one line instead of a traceback mid-load.
    """
    import pickle

    import torch.distributed.checkpoint as dcp

    from kubetune_trainer.checkpoint.training_state import SCHEDULER_FILE, STATE_FILE, SavedState

    try:
        SavedState.from_json((checkpoint / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (ValueError, TypeError, KeyError, AttributeError, UnicodeDecodeError):
        return f"{STATE_FILE} is empty or not a trainer state"
    if not (checkpoint / SCHEDULER_FILE).is_file():
        return f"{SCHEDULER_FILE} is missing"
    index = checkpoint / STATE_DIR / ".metadata"
    try:
        metadata = dcp.FileSystemReader(checkpoint / STATE_DIR).read_metadata()
    except FileNotFoundError:
        return f"{STATE_DIR}/.metadata is missing"
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, ImportError, IndexError,
            KeyError, UnicodeDecodeError, RuntimeError):
        return f"{STATE_DIR}/.metadata is truncated or unreadable"
    if not isinstance(getattr(metadata, "storage_data", None), dict):
        return f"{STATE_DIR}/.metadata is truncated or unreadable"
    needed: dict[str, int] = {}
    for info in metadata.storage_data.values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(needed.items()):
        shard = index.parent / name
        if not shard.is_file():
            return f"{STATE_DIR}/{name} is missing (the index lists it)"
        if shard.stat().st_size < end:
            return f"{STATE_DIR}/{name} is truncated ({shard.stat().st_size} bytes, the index reads up to {end})"
    return None


def refuse_damaged(checkpoint: Path, label: str) -> None:
    """ConfigError naming the checkpoint (`label`: its path or URI), the file and the fix, if damaged.

    Refused rather than passed over for an older one: the damage came after the checkpoint was sealed,
    by something other than the trainer, and resuming from an older checkpoint would save new ones
    over the steps of this one, destroying what its owner may still recover. Deleting it is one
    command, and the next start then resumes from the newest intact checkpoint before it.
    """
    problem = damage(checkpoint)
    if problem is not None:
        raise ConfigError(f"checkpoint {label} is damaged and cannot be resumed: {problem} (its manifest was "
                          "rewritten after the damage); delete it to resume from the newest intact checkpoint "
                          "before it, or point spec.checkpoints.resumeFrom at another checkpoint")


def saved_model_shapes(checkpoint: Path) -> dict[str, tuple[int, ...]]:
    """The trained parameters a checkpoint holds, from its DCP index alone (no tensor is read)."""
    import torch.distributed.checkpoint as dcp

    metadata = dcp.FileSystemReader(checkpoint / STATE_DIR).read_metadata()
    return {key.removeprefix("model."): tuple(item.size) for key, item in metadata.state_dict_metadata.items()
            if key.startswith("model.") and hasattr(item, "size")}


def saved_trained_weights(checkpoint: Path) -> dict[str, torch.Tensor]:
    """The trained parameters of a checkpoint whole, read from its sharded state on one process: the
    EMA average where the run kept one (what the run publishes), else the weights themselves. For a
    checkpoint with no ready-to-pull weights beside it (a full fine-tune's)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(checkpoint / STATE_DIR)
    metadata = reader.read_metadata().state_dict_metadata
    section = "ema" if any(key.startswith("ema.") for key in metadata) else "model"
    state = {section: {key.removeprefix(f"{section}."): torch.empty(item.size, dtype=item.properties.dtype)
                       for key, item in metadata.items() if key.startswith(f"{section}.") and hasattr(item, "size")}}
    dcp.load(state, storage_reader=reader, no_dist=True)
    return state[section]


def full_trained_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every trained parameter whole, on the CPU, on the main process ({} elsewhere).

    A collective under FSDP (the shards are gathered): every process must call it.
    """
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    return get_model_state_dict(model, options=_options(full_state_dict=True, cpu_offload=True))
