"""The data layouts under spec.data.uri (spec.data.layout): how each is read, made into a keyed data
set and batched. Every family builds its data through this table (ModelFamily's data methods);
kubetune_api.families says which layouts a family takes, kubetune_api.data_layouts what each layout is
(one row each; its "how to add a layout" says where a new one goes).

A layout stored as parquet or WebDataset (spec.data.format; kubetune_api.spec_data.DATA_FORMATS says
which layouts each holds) is read by that format's reader (data.stored) into records, of which the
layout's `from_stored` makes its samples; everything after reading is the same as for loose files.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kubetune_api.data_layouts import DATA_LAYOUTS
from kubetune_api.families import FAMILIES
from kubetune_api.spec import TrainingJobSpec
from kubetune_api.spec_data import data_columns, frame_counts
from kubetune_trainer.data import captions, edit_pairs, image_folder, pmg, stored, video, video_captions
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.keyed import KeyedDataset
from kubetune_trainer.data.records import Stored
from kubetune_trainer.data.screening import FileCheck, Screen


@dataclass(frozen=True)
class Layout:
    # Every sample (paths and texts, nothing decoded); bad records go to the Screen.
    read: Callable[[TrainingJobSpec, Screen], list]
    # A data set over some of the samples; training=False: the held-out set, without dropouts.
    dataset: Callable[[list, ImageTransform, TrainingJobSpec, bool], KeyedDataset]
    collate: Callable[[list[dict]], dict]
    # The held-out samples when the layout names a file of them, else None (a fraction is split off).
    held_out: Callable[[TrainingJobSpec, Screen], list | None] = lambda spec, screen: None
    # How the screen checks each file of a sample before training (None: as an image).
    check: Callable[[TrainingJobSpec], FileCheck | None] = lambda spec: None
    # Its samples from the records of spec.data.format parquet or webdataset (None: loose files only).
    from_stored: Callable[[list[Stored], TrainingJobSpec, Screen], list] | None = None
    # Whether a streamed data set is screened before training too (else its files are checked as
    # training reaches them): where the sampler needs what the check finds before the first step.
    screen_streamed: Callable[[TrainingJobSpec], bool] = lambda spec: False
    # Its loose samples as data.restore_data stores them again in those formats: (media file, its name in
    # the data set, caption / class name / instruction, control images) each, in training order.
    loose: Callable[[Path], list[tuple[Path, str, str, tuple[Path, ...]]]] | None = None

    def read_samples(self, spec: TrainingJobSpec, screen: Screen) -> list:
        """Every sample, from loose files or from the format spec.data.format names."""
        if spec.data.format == "files":
            return self.read(spec, screen)
        return self.from_stored(stored.read_stored(spec, screen), spec, screen)


def _read_captions(spec: TrainingJobSpec, screen: Screen) -> list:
    image_column, caption_column, *_ = data_columns(spec.data)
    return captions.read_captions(Path(spec.data.uri), screen, image_column, caption_column)


def _captions_dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    data = spec.data
    return captions.CaptionsDataset(samples, transform, data.caption_dropout if training else 0.0,
                                    spec.training.seed, data.bucketing)


def _read_edit_pairs(spec: TrainingJobSpec, screen: Screen) -> list:
    """How many control images a sample may have is the family's row's max_references."""
    family = spec.model.family
    return edit_pairs.read_edit_pairs(Path(spec.data.uri), screen, FAMILIES[family].max_references, family)


def _edit_pairs_dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    data = spec.data
    return edit_pairs.EditPairsDataset(samples, transform, data.caption_dropout if training else 0.0,
                                       data.control_dropout if training else 0.0, spec.training.seed, data.bucketing)


def _read_image_folder(spec: TrainingJobSpec, screen: Screen) -> list:
    samples, _classes = image_folder.read_image_folder(Path(spec.data.uri), screen)
    return samples


def _image_folder_dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    return image_folder.ImageFolderDataset(samples, transform, spec.training.seed)


def _read_pmg(spec: TrainingJobSpec, screen: Screen) -> list:
    return pmg.read_pmg(Path(spec.data.uri), screen, spec.pmg_options.train_json)


def _pmg_held_out(spec: TrainingJobSpec, screen: Screen) -> list | None:
    """spec.pmg.valJson, the PMG guide's val split, when given."""
    val_json = spec.pmg_options.val_json
    return None if val_json is None else pmg.read_pmg(Path(spec.data.uri), screen, val_json)


def _pmg_dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec, training: bool) -> KeyedDataset:
    return pmg.PmgDataset(samples, transform, spec.training.seed)


def _read_video_captions(spec: TrainingJobSpec, screen: Screen) -> list:
    image_column, caption_column, *_ = data_columns(spec.data)
    return video_captions.read_video_captions(Path(spec.data.uri), screen, image_column, caption_column)


def _video_captions_dataset(samples: list, transform: ImageTransform, spec: TrainingJobSpec,
                            training: bool) -> KeyedDataset:
    """A clip's start is drawn per epoch; once per clip with the embedding cache (its latents reused)."""
    data = spec.data
    return video_captions.VideoCaptionsDataset(
        samples, transform, frame_counts(data.frames), data.fps, data.caption_dropout if training else 0.0,
        spec.training.seed, data.bucketing, random_start=training, start_per_sample=data.cache.enabled)


def _clip_check(spec: TrainingJobSpec) -> FileCheck:
    """Every clip: a video, not empty, and holding the shortest of spec.data.frames at spec.data.fps."""
    return video.ClipCheck(min(frame_counts(spec.data.frames)), spec.data.fps)


def _screen_streamed_clips(spec: TrainingJobSpec) -> bool:
    """Streamed clips are probed before the first step (from their headers, each process its share)
    only where that step needs them: to batch by their frame counts or aspect ratios, or to skip the
    bad ones (spec.data.skipBad: every process must leave out the same). Else each is probed as
    training reaches it, in the loader worker that decodes it, as streamed images are checked."""
    return spec.data.skip_bad or video_captions.needs_clip_facts(frame_counts(spec.data.frames), spec.data.bucketing)


LAYOUTS: dict[str, Layout] = {
    "captions": Layout(_read_captions, _captions_dataset, captions.collate, from_stored=stored.captioned,
                       loose=captions.loose_samples),
    "edit-pairs": Layout(_read_edit_pairs, _edit_pairs_dataset, edit_pairs.collate, from_stored=stored.edit_pairs,
                         loose=edit_pairs.loose_samples),
    "pmg": Layout(_read_pmg, _pmg_dataset, pmg.collate, held_out=_pmg_held_out),
    "image-folder": Layout(_read_image_folder, _image_folder_dataset, image_folder.collate,
                           from_stored=stored.labelled, loose=image_folder.loose_samples),
    "video-captions": Layout(_read_video_captions, _video_captions_dataset, video_captions.collate,
                             check=_clip_check, from_stored=stored.captioned_clips,
                             screen_streamed=_screen_streamed_clips, loose=video_captions.loose_samples),
}
assert LAYOUTS.keys() == DATA_LAYOUTS.keys(), "a trainer entry for each row of kubetune_api.data_layouts"
