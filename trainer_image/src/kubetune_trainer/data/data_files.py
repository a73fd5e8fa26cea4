"""A data set's own files (metadata.jsonl, a pmg JSON list, an edit pair's instruction) and the text
they hold, read by the rules every layout shares: a file inside the data set (a symbolic link out of
it is refused, storage.confine), a regular file (a FIFO would block the reader for ever), and text
that is text (a JSON escape like "\\ud800" decodes to a lone surrogate, which no tokenizer takes);
and the files of a kind a layout finds by walking the data set (files_with)."""
from __future__ import annotations

import os
from pathlib import Path

from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, confined
from kubetune_trainer.storage.stream import MEMBERS_SUFFIX, NotARegularFile, regular_file


def files_with(root: Path, suffixes: tuple[str, ...]) -> list[Path]:
    """Every file under root whose suffix (any case) is one of SUFFIXES, in path order (the same on
    every node, whatever order the file system lists them in). Hidden files and folders, the copies
    of streamed containers' members (CONTAINER.members/) and folders behind symbolic links are left out."""
    found = []
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if not name.startswith(".") and not name.endswith(MEMBERS_SUFFIX)]
        found += [Path(folder, name) for name in files
                  if not name.startswith(".") and os.path.splitext(name)[1].lower() in suffixes]
    return sorted(found, key=lambda path: path.relative_to(root).parts)


def data_file(root: Path, name: str) -> Path | None:
    """root/name when it is a regular file inside root; None when there is none; else ConfigError
    naming it (a link out of the data set, a FIFO, a directory)."""
    try:
        path = confined(root, name, "data file")
    except UnsafePath as err:
        raise ConfigError(f"spec.data.uri: {err}; a data set's files stay inside it: copy the file in instead "
                          "of linking to it") from None
    if not path.exists():
        return None
    try:
        return regular_file(path)
    except NotARegularFile as err:
        raise ConfigError(f"{path}: {err}") from None


def not_text(value: str, field: str) -> str | None:
    """Why VALUE (from JSON) is not text a model can read, or None: a lone surrogate (U+D800 to
    U+DFFF, written as an escape such as "\\ud800") is half of a UTF-16 pair and no character."""
    for offset, char in enumerate(value):
        if "\ud800" <= char <= "\udfff":
            return (f"{field} holds a lone surrogate \\u{ord(char):04x} at character {offset} (half of a UTF-16 pair, "
                    "not a character); write the character itself, or its pair of escapes")
    return None
