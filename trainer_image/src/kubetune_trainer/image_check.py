"""What the trainer image must hold, checked as the user its pods run as (`python -m kubetune_trainer.image_check`).

The image's build runs this after `USER 10001:10001`, so an image that cannot train fails to build instead
of failing in a pod: every module of the trainer imports (that pulls in torch, diffusers, transformers,
peft, accelerate, boto3, pyarrow... exactly as the trainer does), the libraries the trainer imports only
when a job asks for them load too (bitsandbytes, torchao, PyAV's codecs, Pillow's image formats), and
every installed file is readable by this user (a file only root can read would fail later, at the first
job that touches it).
"""
from __future__ import annotations

import importlib
import io
import os
import pkgutil
import site
import sys
import sysconfig
from importlib import metadata

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

import kubetune_trainer

# What the trainer takes from the libraries it imports inside functions, only for the jobs that ask for
# it (spec.training.optimizer adamw8bit, spec.model.quantization fp8/nf4).
ON_DEMAND = (
    ("bitsandbytes.optim", "AdamW8bit"),
    ("torchao.quantization", "Float8Tensor"),
    ("torchao.quantization", "Float8WeightOnlyConfig"),
)
# Top-level names some wheels ship their own test suites under (torchao's `test`): not the library.
SHIPPED_TESTS = {"test", "tests"}
DISTRIBUTION = "kubetune"
EXTRA = "trainer"
# The video-captions layout's codecs (decoding) and the one the tests' clips are written with.
VIDEO_DECODERS = ("h264", "hevc", "vp9", "av1")
# The image formats data sets arrive in, each written and read back through Pillow.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP")


def trainer_modules() -> list[str]:
    """Every module of the trainer package, found by walking it (nothing listed by hand)."""
    return sorted(info.name for info in pkgutil.walk_packages(kubetune_trainer.__path__, "kubetune_trainer."))


def dependency_modules() -> list[str]:
    """The top-level modules of every distribution the trainer extra requires (read from the installed
    kubetune's metadata): what the trainer may import, at module level or inside a function."""
    requirements = [Requirement(text) for text in metadata.requires(DISTRIBUTION) or []]
    wanted = {canonicalize_name(r.name) for r in requirements
              if r.marker is None or r.marker.evaluate({"extra": EXTRA})}
    return sorted(module for module, distributions in metadata.packages_distributions().items()
                  if not module.startswith("_") and "." not in module and module not in SHIPPED_TESTS
                  and wanted & {canonicalize_name(name) for name in distributions})


def check_imports(modules: list[str]) -> list[str]:
    problems = []
    for name in modules + [module for module, _ in ON_DEMAND]:
        if name == __name__:
            continue
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - every failure is reported, the build then fails
            problems.append(f"import {name}: {type(error).__name__}: {error}")
    for module, attribute in ON_DEMAND:
        if module in sys.modules and not hasattr(sys.modules[module], attribute):
            problems.append(f"{module} has no {attribute}")
    return problems


def check_media() -> list[str]:
    problems = []
    import av
    from PIL import Image

    for codec in VIDEO_DECODERS:
        try:
            av.codec.Codec(codec, "r")
        except Exception as error:  # noqa: BLE001
            problems.append(f"PyAV cannot decode {codec}: {error}")
    for image_format in IMAGE_FORMATS:
        try:
            buffer = io.BytesIO()
            Image.new("RGB", (8, 8), (200, 30, 30)).save(buffer, format=image_format)
            buffer.seek(0)
            Image.open(buffer).convert("RGB").load()
        except Exception as error:  # noqa: BLE001
            problems.append(f"Pillow cannot write and read {image_format}: {error}")
    return problems


def unreadable_files() -> list[str]:
    """Installed files (site-packages, the trainer's own) this user cannot read."""
    roots = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"], *site.getsitepackages(),
             os.path.dirname(kubetune_trainer.__path__[0])}
    found = []
    for root in sorted(path for path in roots if os.path.isdir(path)):
        for folder, subfolders, files in os.walk(root):
            # A folder this user cannot list or enter is named here: os.walk would skip it without a word.
            closed = [name for name in subfolders if not os.access(os.path.join(folder, name), os.R_OK | os.X_OK)]
            found += [os.path.join(folder, name) + "/" for name in closed]
            subfolders[:] = [name for name in subfolders if name not in closed]
            found += [os.path.join(folder, name) for name in files
                      if not os.path.islink(os.path.join(folder, name))
                      and not os.access(os.path.join(folder, name), os.R_OK)]
    return found


def main() -> int:
    dependencies, own = dependency_modules(), trainer_modules()
    problems = check_imports(dependencies + own) + check_media()
    unreadable = unreadable_files()
    if unreadable:
        problems.append(f"{len(unreadable)} installed files unreadable by UID {os.getuid()}, e.g. "
                        + ", ".join(unreadable[:5]))
    if problems:
        for problem in problems:
            print(f"kubetune image check: {problem}", file=sys.stderr)
        print(f"kubetune image check: FAILED as UID {os.getuid()}: the image cannot train; fix the Dockerfile's "
              "install step", file=sys.stderr)
        return 1
    print(f"kubetune image check: {len(dependencies)} modules of the trainer's dependencies, "
          f"{len(own)} trainer modules, {len(ON_DEMAND)} on-demand imports, "
          f"{len(VIDEO_DECODERS)} video decoders and {len(IMAGE_FORMATS)} image formats load as UID {os.getuid()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
