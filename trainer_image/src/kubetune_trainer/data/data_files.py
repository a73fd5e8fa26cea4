"""A data set's own files (metadata.jsonl, a pmg JSON list, an edit pair's instruction) and the text
they hold, read by the rules every layout shares: a file inside the data set (a symbolic link out of
it is refused, storage.confine), a regular file (a FIFO would block the reader for ever), and text
that is text (a JSON escape like "\\ud800" decodes to a lone surrogate, which no tokenizer takes)."""
from __future__ import annotations

from pathlib import Path

from kubetune_trainer.errors import ConfigError
from kubetune_trainer.storage.confine import UnsafePath, confined
from kubetune_trainer.storage.stream import NotARegularFile, regular_file


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
