"""Captions as files beside their images: NAME.png with NAME.txt, the way kohya sd-scripts, ai-toolkit,
musubi-tuner and SimpleTuner's `textfile` captions keep a data set (clips too: NAME.mp4 with NAME.txt).

The captions and video-captions layouts read this when their folder has no metadata.jsonl (nor
metadata.csv). Every image (clip) under the folder, subfolders included (their names mean nothing:
no repeat counts), is a sample in the order of its path; its caption is the whole text of NAME.txt,
stripped of surrounding white space (a byte-order mark too: Windows editors write one). An empty
NAME.txt is an empty caption; an image without one is a bad sample, named. Hidden files and folders
(".cache", ".ipynb_checkpoints") are not read, nor folders reached through a symbolic link; a linked
image that leads out of the data set is refused as everywhere else (storage.confine).
"""
from __future__ import annotations

from pathlib import Path

from kubetune_trainer.data.data_files import files_with
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.storage.confine import UnsafePath, inside
from kubetune_trainer.storage.stream import NotARegularFile, regular_file

CAPTION_SUFFIX = ".txt"


def read_caption_files(root: Path, screen: Screen, suffixes: tuple[str, ...], what: str) -> list[tuple[Path, str]]:
    """(file, caption) of every `what` (images, clips) under root with NAME.txt beside it; one
    without, or whose caption cannot be read, goes to the screen."""
    samples = []
    for path in files_with(root, suffixes):
        caption_file = path.with_suffix(CAPTION_SUFFIX)
        try:
            inside(root, path, "data file")
            inside(root, caption_file, "caption file")
            caption = regular_file(caption_file).read_bytes().decode("utf-8-sig").strip()
        except FileNotFoundError:
            screen.reject(str(path), f"no caption {caption_file.name} beside it (without metadata.jsonl or "
                                     f"metadata.csv, each of the {what} needs NAME{CAPTION_SUFFIX}; an empty one is "
                                     "an empty caption)")
            continue
        except (NotARegularFile, UnsafePath) as err:
            screen.reject(str(caption_file if isinstance(err, NotARegularFile) else path), str(err))
            continue
        except UnicodeDecodeError as err:
            screen.reject(str(caption_file), f"not UTF-8 text (byte {err.start}); save it as UTF-8")
            continue
        samples.append((path, caption))
    return samples
