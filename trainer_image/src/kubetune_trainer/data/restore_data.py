"""A loose data set stored again as parquet files or WebDataset shards (spec.data.format), the way
people's tools write them, for tests, demos and benchmarks: the same samples in the same order.

Parquet as Hugging Face `datasets` writes it: an `image` column of {bytes, path} structs, a `text`
(captions) or `label` column (image-folder: ClassLabel indices, their names in the "huggingface"
schema metadata), edit pairs a `control_image` column too (a list of images per row, datasets'
`Sequence(Image())`, where some pair has several control images), row groups of `rows_per_group`; video-captions
a `video` column (datasets' Video feature) instead of `image`.
WebDataset: KEY.png + KEY.txt or KEY.cls (the class name) members, edit pairs' KEY.control.jpg (or
KEY.control_0.jpg, ...), video-captions KEY.mp4 + KEY.txt, shards of `per_file` samples.
"""
from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from kubetune_api.data_layouts import DATA_LAYOUTS
from kubetune_trainer.data.layouts import LAYOUTS


def loose_samples(layout: str, root: Path) -> list[tuple[Path, str, str, tuple[Path, ...]]]:
    """(media file, its name in the data set, caption, class name or instruction, control images) of each
    sample, in training order."""
    loose = LAYOUTS[layout].loose
    if loose is None:
        raise ValueError(f"no parquet or WebDataset form for layout {layout!r}")
    return loose(root)


def _chunks(items: list, size: int) -> list[list]:
    return [items[start:start + size] for start in range(0, len(items), size)]


def write_parquet(layout: str, loose: Path, out: Path, per_file: int = 4, rows_per_group: int = 2) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    row = DATA_LAYOUTS[layout]
    samples = loose_samples(layout, loose)
    several = any(len(controls) > 1 for *_, controls in samples)  # then control_image holds a list per row
    classes = sorted({text for _, _, text, _ in samples})
    out.mkdir(parents=True, exist_ok=True)
    image_type = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    if row.labels:
        fields, features = [("label", pa.int64())], {"label": {"names": classes, "_type": "ClassLabel"}}
    else:
        fields, features = [("text", pa.string())], {"text": {"dtype": "string", "_type": "Value"}}
    media = "video" if row.clips else "image"  # datasets' Video feature: {bytes, path} too
    images = [media] + (["control_image"] if row.edits else [])
    feature = {c: {"_type": media.title()} for c in images}
    types = {c: image_type for c in images}
    if several:
        feature["control_image"] = {"_type": "Sequence", "feature": {"_type": "Image"}}
        types["control_image"] = pa.list_(image_type)
    metadata = {"huggingface": json.dumps({"info": {"features": {**feature, **features}}})}
    schema = pa.schema([*types.items(), *fields], metadata=metadata)
    for number, part in enumerate(_chunks(samples, per_file)):
        values = [classes.index(text) if row.labels else text for _, _, text, _ in part]
        columns = {media: [{"bytes": image.read_bytes(), "path": name} for image, name, _, _ in part]}
        if row.edits:
            structs = [[{"bytes": c.read_bytes(), "path": c.name} for c in controls] for *_, controls in part]
            columns["control_image"] = structs if several else [row[0] for row in structs]
        table = pa.table({**columns, fields[0][0]: values}, schema=schema)
        pq.write_table(table, out / f"train-{number:05d}.parquet", row_group_size=rows_per_group)
    return out


def write_webdataset(layout: str, loose: Path, out: Path, per_file: int = 4) -> Path:
    text_member = "cls" if DATA_LAYOUTS[layout].labels else "txt"
    out.mkdir(parents=True, exist_ok=True)
    for number, part in enumerate(_chunks(loose_samples(layout, loose), per_file)):
        with tarfile.open(out / f"shard-{number:05d}.tar", "w") as tar:
            for image, name, text, controls in part:
                key = name.split(".")[0]  # a WebDataset key: the name up to its first dot
                numbered = [f"control_{i}" for i in range(len(controls))] if len(controls) > 1 else ["control"]
                for member, data in ((name, image.read_bytes()),
                                     *((f"{key}.{n}{c.suffix}", c.read_bytes()) for n, c in zip(numbered, controls)),
                                     (f"{key}.{text_member}", text.encode())):
                    info = tarfile.TarInfo(member)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return out
