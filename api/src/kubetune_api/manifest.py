"""Reading a TrainingJob manifest: YAML, `--set` overrides, validation, readable errors.

Errors name the field by its manifest path (spec.training.learningRate) and say what is allowed,
because that is what a user has to edit.
"""
from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from kubetune_api.spec import TrainingJob


MAX_MANIFEST_BYTES = 1024 * 1024  # the API server refuses objects over 1.5 MiB; a manifest is far smaller
MAX_NESTING = 64  # a TrainingJob nests about 6 levels; far under Python's recursion limit


class ManifestLoader(yaml.SafeLoader):
    """YAML as the API server reads it: `1e-4` is a number (PyYAML's YAML 1.1 makes it a string).

    Aliases (`*name`) are refused: a few lines of nested aliases expand to billions of nodes (a
    "billion laughs" document), and a TrainingJob never needs them. Nesting is bounded (a few KB of
    `[[[[...` would otherwise end in a RecursionError, which is no YAMLError), and a key written
    twice in one mapping is refused naming it and its line (YAML's "last wins" silently drops the
    first, which the API server's strict decoding refuses too).
    """

    _depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            mark = self.peek_event().start_mark
            raise yaml.composer.ComposerError(
                None, None, "YAML aliases (*name) are not accepted in a TrainingJob manifest: write the value out",
                mark)
        if self._depth >= MAX_NESTING:
            raise yaml.composer.ComposerError(
                None, None, f"nested deeper than {MAX_NESTING} levels; a TrainingJob is a few levels deep",
                self.peek_event().start_mark)
        self._depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            if isinstance(key, (str, int, float, bool)) and key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"the key {key!r} is written twice in one mapping (first on line {seen[key] + 1}); "
                    "keep one", key_node.start_mark)
            if isinstance(key, (str, int, float, bool)):
                seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep=deep)


ManifestLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def load_yaml(text: str) -> Any:
    return yaml.load(text, Loader=ManifestLoader)


def read_manifest_text(path: Path) -> str:
    """The manifest file as text: bounded in size and UTF-8, or a ManifestError saying which."""
    size = path.stat().st_size
    if size > MAX_MANIFEST_BYTES:
        raise ManifestError([f"{path} is {size} bytes; a TrainingJob manifest is at most {MAX_MANIFEST_BYTES}"])
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as err:
        raise ManifestError([f"{path} is not UTF-8 text (byte {err.start}): save it as UTF-8"]) from None


class ManifestError(ValueError):
    """A manifest that cannot become a TrainingJob; str() lists one problem per line."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__("\n".join(f"  - {p}" for p in problems))


def load_manifest(path: Path, overrides: Iterable[str] = ()) -> TrainingJob:
    """Read a manifest file, apply `PATH=VALUE` overrides, and validate it."""
    return parse_manifest(apply_overrides(read_document(path, "TrainingJob"), overrides))


def read_document(path: Path, kind: str) -> dict[str, Any]:
    """The one document of KIND in the YAML file PATH."""
    text = read_manifest_text(path)
    try:
        documents = [d for d in yaml.load_all(text, Loader=ManifestLoader) if d is not None]
    except yaml.YAMLError as err:
        raise ManifestError([f"not valid YAML: {err}"]) from None
    found = [d for d in documents if isinstance(d, dict) and d.get("kind") == kind]
    if len(found) != 1:
        raise ManifestError([f"expected exactly one {kind} document in {path}, found {len(found)}"])
    return found[0]


def parse_manifest(document: Mapping[str, Any], model: type[BaseModel] = TrainingJob) -> Any:
    """Validate a manifest mapping (a TrainingJob, or MODEL); raise ManifestError naming each bad field."""
    try:
        return model.model_validate(document)
    except ValidationError as err:
        raise ManifestError(describe_errors(err, model)) from None


def apply_overrides(document: Mapping[str, Any], overrides: Iterable[str]) -> dict[str, Any]:
    """Return a copy with each `a.b.c=VALUE` set; VALUE is parsed as YAML (2 → int, "2" → str)."""
    result = yaml.safe_load(yaml.safe_dump(dict(document)))  # deep copy of plain data
    for override in overrides:
        path, sep, raw = override.partition("=")
        if not sep or not path:
            raise ManifestError([f"--set {override!r}: expected PATH=VALUE, e.g. spec.training.maxSteps=2"])
        keys = path.split(".")
        node = result
        for key in keys[:-1]:
            child = node.setdefault(key, {})
            if not isinstance(child, dict):
                raise ManifestError([f"--set {override!r}: {key} is not a mapping"])
            node = child
        try:
            node[keys[-1]] = load_yaml(raw) if raw else ""
        except yaml.YAMLError as err:
            problem = getattr(err, "problem", None) or str(err).splitlines()[0]
            raise ManifestError([f"--set {path}=...: the value is not valid YAML ({problem}); quote a string, "
                                 "e.g. --set 'spec.data.uri=\"a: b\"'"]) from None
    return result


def describe_errors(err: ValidationError, model: type[BaseModel] = TrainingJob) -> list[str]:
    """Turn pydantic's errors into `field.path: what is wrong; what is allowed` lines (a rule that
    found several problems gives them one per line)."""
    problems = []
    for error in err.errors(include_url=False):
        location = ".".join(str(part) for part in error["loc"])
        message = error["msg"].removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = _unknown_field_message(error["loc"], model)
        elif "input" in error and not isinstance(error["input"], (dict, list)) and error["type"] != "missing":
            message = f"{message} (got {redacted(error['input'])!r})"
            if error["input"] is False and "'no'" in message:
                message += '; YAML reads an unquoted no as false: write "no"'
        if message.startswith(("spec.", "metadata.")):
            problems += message.split("\n")  # a cross-field rule that names its own fields
        else:
            problems.append(f"{location}: {message}" if location else message)
    return problems


_URL_CREDENTIALS = re.compile(r"(?<=://)[^/@\s]+@")


def redacted(value: Any) -> Any:
    """A rejected value as an error may repeat it: credentials inside a URL (user:password@) hidden."""
    return _URL_CREDENTIALS.sub("***@", value) if isinstance(value, str) else value


def _unknown_field_message(loc: tuple[Any, ...], root: type[BaseModel]) -> str:
    allowed = _allowed_fields(loc[:-1], root)
    hint = difflib.get_close_matches(str(loc[-1]), allowed, n=1, cutoff=0.6)
    text = "unknown field"
    if hint:
        text += f"; did you mean {hint[0]!r}?"
    if allowed:
        text += f" Allowed here: {', '.join(allowed)}"
    return text


def _allowed_fields(parent: tuple[Any, ...], root: type[BaseModel]) -> list[str]:
    """The camelCase field names the model accepts at a manifest path."""
    model: type[BaseModel] | None = root
    for part in parent:
        field = field_by_alias(model, str(part)) if model else None
        annotation = field.annotation if field else None
        model = model_in(annotation)
    if model is None:
        return []
    return [f.alias or name for name, f in model.model_fields.items()]


def field_by_alias(model: type[BaseModel], alias: str):
    for name, field in model.model_fields.items():
        if (field.alias or name) == alias:
            return field
    return None


def model_in(annotation: Any) -> type[BaseModel] | None:
    """The pydantic model inside an annotation such as Optional[Model]."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in getattr(annotation, "__args__", ()):
        found = model_in(arg)
        if found:
            return found
    return None
