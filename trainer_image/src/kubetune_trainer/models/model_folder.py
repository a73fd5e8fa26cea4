"""A local model folder's config files are checked before anything is built from them.

`kubetune plan` builds every component from its config.json on the meta device and the trainer
loads them with from_pretrained: a config that is not JSON, a JSON list, a negative or zero size, a
file where the folder should be, each came out as a traceback from deep inside transformers or
diffusers, and an absurd layer count (10^8) made `plan` build modules until it ran out of memory.
Each is refused here in one line naming the config file and its key; so is a file the trainer's
user cannot read (check_readable).

Stated limits, on every config.json of the model's components (nested configs too, as
text_config.num_hidden_layers):
- a layer or block count (an integer key ending in layers, blocks, depth or layers_per_block, or a
  list of them) is 0 to MAX_LAYERS;
- a size (an integer key ending in size, dim, channels, heads or features, or a list of them as
  block_out_channels) is at least 1;
- a config file is a regular file of at most MAX_CONFIG_BYTES holding a JSON object.
"""
from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path

from kubetune_trainer.errors import ConfigError

MAX_LAYERS = 1024            # the largest published diffusion or language models have ~100-200
MAX_CONFIG_BYTES = 1 << 20   # real config.json files are a few KB
LAYER_KEY = re.compile(r"(layers|blocks|depth|depths|n_layer|layers_per_block)$")
SIZE_KEY = re.compile(r"(size|dim|dims|channels|heads|features)$")


def model_folder(uri: str, field: str) -> Path:
    """A local model URI as a folder, or a ConfigError naming the field (a file is not a model)."""
    path = Path(uri).expanduser()
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{field}: {uri} is a file, not a model folder; name the folder that holds "
                          "model_index.json or config.json (and the components' subfolders)")
    return path


def read_model_config(file: Path) -> dict:
    """config.json's object, checked against the limits above; a ConfigError naming the file else."""
    if not file.is_file():
        raise ConfigError(f"{file}: is not a regular file; a model's config.json is a JSON object")
    if file.stat().st_size > MAX_CONFIG_BYTES:
        raise ConfigError(f"{file}: is {file.stat().st_size} bytes, more than a model config's {MAX_CONFIG_BYTES}; "
                          "is it the right file?")
    try:
        config = json.loads(file.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as err:
        raise ConfigError(f"{file}: is not JSON ({type(err).__name__}: {err}); write the model's config again "
                          "(e.g. save_pretrained)") from None
    if not isinstance(config, dict):
        raise ConfigError(f"{file}: holds a JSON {type(config).__name__}, not the object a model config is")
    problem = config_problem(config)
    if problem:
        raise ConfigError(f"{file}: {problem}")
    return config


def config_problem(config: dict, prefix: str = "") -> str | None:
    """The first key of CONFIG (nested objects included) outside the stated limits, or None."""
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            if problem := config_problem(value, f"{name}."):
                return problem
            continue
        numbers = value if isinstance(value, list) else [value]
        if not numbers or not all(isinstance(n, int) and not isinstance(n, bool) for n in numbers):
            continue
        if LAYER_KEY.search(key) and not all(0 <= n <= MAX_LAYERS for n in numbers):
            return (f"{name} is {value}: a layer count is 0 to {MAX_LAYERS} (kubetune plan and the trainer build "
                    "every layer); correct the config")
        if SIZE_KEY.search(key) and not all(n >= 1 for n in numbers):
            return f"{name} is {value}: a size is at least 1; correct the config"
    return None


def check_readable(root: Path, field: str) -> None:
    """Every file and folder of the model folder ROOT readable by this process's user, or a ConfigError
    naming the first that is not. A trainer pod runs as UID 10001; a model saved by root through a
    temporary file (transformers' and huggingface_hub's writers) is mode 0600, and safetensors then
    reports the file as missing ("No such file or directory"), which sends its owner looking elsewhere."""
    for folder, subfolders, files in os.walk(root):
        for name in subfolders + files:
            path = Path(folder) / name
            wanted = os.R_OK | (os.X_OK if name in subfolders else 0)
            if not os.access(path, wanted):
                info = path.stat()
                raise ConfigError(
                    f"{field}: {path} is not readable by the trainer's user (UID {os.getuid()}; its owner is UID "
                    f"{info.st_uid}, mode {stat.S_IMODE(info.st_mode):04o}): make the model's files readable "
                    "(chmod -R a+rX on the volume) or give them to that user")


def check_configs(root: Path, subfolders: list[str]) -> None:
    """Every config.json the model's components have under root (root itself for ''), each checked;
    missing ones are left to the loader, which names them."""
    for subfolder in subfolders:
        file = root / subfolder / "config.json"
        if file.exists() or file.is_symlink():
            read_model_config(file)
