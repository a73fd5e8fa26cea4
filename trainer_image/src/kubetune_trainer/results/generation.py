"""Images from a trained run or from its base model: what `kubetune generate` draws, and what evaluation scores.

No sampler of its own: a family draws its images as its validation does (ModelFamily.sample_images),
from the TrainingJob the run trained, with a Draw (drawing.Draw) of the request's prompts, steps,
guidance and seed where validation's is of spec.validation's, and with the inputs validation hands
it: batches built by the family's own layout (the held-out edit pairs, PMG's held-out users, or the
control images given). The trained weights go into the family's trained module through
Trainable.load, the counterpart of the writer that saved them.

Nothing here reads a command line or the cluster: `kubetune generate` is a shell over it, and a pod
running the trainer image could run the same calls next to the run's weights.

    generator = Generator(job, device)           # the base model, as the run loaded it
    base = generator.generate(Request(), "base")
    generator.load_weights(Path("final"))        # the run's final weights, or checkpoint-N/
    tuned = generator.generate(Request(prompts=("a red square",)), "final")
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kubetune_api.data_layouts import DATA_LAYOUTS
from kubetune_api.families import FAMILIES
from kubetune_api.spec import TrainingJob
from kubetune_trainer.results.drawing import Draw
from kubetune_trainer.results.sample_clips import Clip
from kubetune_trainer.results.validation import image_grid, ordered_batches

log = logging.getLogger("kubetune.trainer")


class GenerationError(ValueError):
    """Input generation cannot use, in one line naming the option or file and the fix."""


@dataclass(frozen=True)
class Request:
    """What to draw. Nothing given: the job's validation inputs (its prompts, else its held-out captions;
    edit families: its held-out pairs; PMG: its held-out users' captions with their histories)."""

    prompts: tuple[str, ...] = ()
    controls: tuple[Path, ...] = ()  # edit families: one control image per prompt, in order
    steps: int | None = None         # denoising steps (default: the job's spec.validation.numInferenceSteps)
    guidance: float | None = None    # (default: spec.validation.guidanceScale, else the family's)
    seed: int | None = None          # (default: the job's spec.training.seed)
    count: int | None = None         # held-out samples drawn without prompts (default: spec.validation.numSamples)


@dataclass(frozen=True)
class Generated:
    image: Any                # a PIL image
    prompt: str
    seed: int                 # the generator's seed for the whole draw ...
    index: int                # ... of which this is the index-th image
    step: int | str           # the weights': a checkpoint's step, "final", or "base"
    family: str
    job: str
    history: str | None = None  # PMG: the user's history it was drawn for

    def metadata(self) -> dict[str, str]:
        """The PNG text chunks: what drew it."""
        fields = {"prompt": self.prompt, "seed": str(self.seed), "index": str(self.index), "step": str(self.step),
                  "family": self.family, "job": self.job}
        return {**fields, **({"history": self.history} if self.history is not None else {})}


def accepts_controls(family: str) -> bool:
    """Whether the family edits control images (it reads the edit-pairs layout)."""
    return any(DATA_LAYOUTS[layout].edits for layout in FAMILIES[family].layouts)


def draws_from_text(family: str) -> bool:
    """Whether the family draws from a prompt alone (it reads a layout besides edit pairs)."""
    return any(not DATA_LAYOUTS[layout].edits for layout in FAMILIES[family].layouts)


def draws_images(family: str) -> bool:
    """Whether the family draws images at all: its validation images are what CLIP scores (the
    classifier's are not: it draws none)."""
    return bool({"clip_score", "clip_directional"} & set(FAMILIES[family].metrics))


def check_request(family: str, request: Request) -> None:
    """Refuse, before any model loads, what the family cannot draw."""
    if not draws_images(family):
        raise GenerationError(f"{family} draws no images (it {FAMILIES[family].summary.removeprefix('trains ')}); "
                              "use kubetune evaluate")
    if request.controls and not accepts_controls(family):
        raise GenerationError(f"--control: {family} generates from text alone, not from control images; "
                              "drop --control")
    if request.controls and len(request.controls) != len(request.prompts):
        raise GenerationError(f"--control: {len(request.controls)} control image(s) for {len(request.prompts)} "
                              "--prompt(s); give one --prompt (the instruction) per --control, in order")
    if request.prompts and not request.controls and not draws_from_text(family):
        raise GenerationError(f"--prompt: {family} edits images; give each --prompt its --control IMAGE")
    for control in request.controls:
        check_image(control)


def check_image(path: Path) -> None:
    from PIL import Image, UnidentifiedImageError

    from kubetune_trainer.data.image_input import ImageRefused, check_bounds

    if not path.is_file():
        raise GenerationError(f"--control {path}: no such file (or not a regular file)")
    try:
        with Image.open(path) as image:
            check_bounds(image.size)  # from the header: the loader then decodes it by image_input's rules
            image.verify()
    except ImageRefused as err:
        raise GenerationError(f"--control {path}: {err}") from None
    except (UnidentifiedImageError, OSError, SyntaxError, Image.DecompressionBombError) as err:
        raise GenerationError(f"--control {path}: not a readable image ({err})") from None


def inference_dtype(job: TrainingJob, device: torch.device) -> torch.dtype:
    """The training precision on a GPU; fp32 on the CPU (where half precision is slow or missing)."""
    from kubetune_trainer.run import WEIGHT_DTYPES

    return WEIGHT_DTYPES[job.spec.training.mixed_precision] if device.type == "cuda" else torch.float32


class Generator:
    """A job's family loaded for drawing on `device`: the base model until load_weights."""

    def __init__(self, job: TrainingJob, device: torch.device | str = "cpu", dtype: torch.dtype | None = None):
        from kubetune_trainer.families import family_for
        from kubetune_trainer.run import check_local_inputs, quiet_libraries, with_local_inputs

        self.job, self.device = job, torch.device(device)
        quiet_libraries()
        spec = job.spec
        # The run's own starting LoRA (initFrom) is not the base, and the trained weights replace it anyway.
        spec = spec.model_copy(update={"adapter": spec.adapter.model_copy(update={"init_from": None})})
        # The models are fetched now; the data set (possibly large, in S3) only when a draw reads its
        # held-out samples (_read_held_out).
        spec = with_local_inputs(spec.model_copy(update={"data": spec.data.model_copy(update={"uri": "."})}))
        spec = spec.model_copy(update={"data": job.spec.data})
        check_local_inputs(spec)
        self.spec = spec
        self.family_name = spec.model.family
        self.family = family_for(self.family_name)(spec, self.device, dtype or inference_dtype(job, self.device))
        self.family.trainable_module.eval()
        self.weights: int | str = "base"
        self._held_out: list[dict] | None = None

    # --- weights ------------------------------------------------------------------------------

    def load_weights(self, folder: Path, step: int | str = "final") -> None:
        """The weights a run saved in `folder` (its final ones, a checkpoint-N/ or a best/step-N/ folder),
        in place of the base's; `step` names them in what generate returns."""
        self.family.trainable.load(Path(folder))
        self.weights = step

    # --- drawing ------------------------------------------------------------------------------

    def draw_of(self, request: Request, prompts: list[str] | None = None, count: int | None = None,
                seed: int | None = None) -> Draw:
        """The request's draw, spec.validation's where the request leaves a choice out: `prompts` (None:
        the job's validation prompts), else `count` held-out samples (None: the request's count, else
        numSamples). Held-out samples are drawn whether or not the job names a CLIP model."""
        validation = self.spec.validation
        return Draw(prompts=tuple(validation.prompts if prompts is None else prompts),
                    count=count if count is not None else (request.count or validation.num_samples or 1),
                    steps=request.steps if request.steps is not None else validation.num_inference_steps,
                    guidance=request.guidance if request.guidance is not None else self.spec.sample_guidance,
                    seed=seed if seed is not None else (request.seed if request.seed is not None
                                                        else self.spec.training.seed),
                    held_out=True)

    def held_out(self) -> list[dict]:
        """The job's held-out batches (else its first samples), as validation reads them; [] when its
        data is not reachable from here."""
        if self._held_out is None:
            self._held_out = self._read_held_out()
        return self._held_out

    def _read_held_out(self) -> list[dict]:
        from kubetune_trainer.storage.inputs import local_copy

        uri = local_copy(self.spec.data.uri)
        if not Path(uri).exists():
            log.warning("spec.data.uri %s is not reachable from here: no held-out samples to draw from", uri)
            return []
        shared = self.family.spec  # the family and its parts read the data set where this node has it
        shared.data = shared.data.model_copy(update={"uri": uri})
        samples = self.family.read_samples()
        _, held_out = self.family.build_datasets(samples)
        if held_out is None:  # no held-out split: the first samples, as edit families' validation does
            held_out = self.family.make_dataset(samples[:self.spec.validation.num_samples or 1], False)
        return [batch for _, batch in ordered_batches(held_out, self.spec.training.batch_size, self.family.collate)]

    def _control_batches(self, request: Request) -> list[dict]:
        """The given control images and instructions as the edit-pairs layout batches them (each its
        own target: validation never reads the target)."""
        from kubetune_trainer.data.edit_pairs import EditPair

        pairs = [EditPair((path,), path, prompt) for path, prompt in zip(request.controls, request.prompts)]
        dataset = self.family.make_dataset(pairs, False)
        return [batch for _, batch in ordered_batches(dataset, self.spec.training.batch_size, self.family.collate)]

    def generate(self, request: Request, step: int | str | None = None) -> list[Generated]:
        """Draw the request with the weights loaded now (the base model before load_weights)."""
        check_request(self.family_name, request)
        if request.controls:
            batches, prompts = self._control_batches(request), []
            count = len(request.controls)
        elif request.prompts:
            batches, prompts, count = self.held_out_if_needed(), list(request.prompts), len(request.prompts)
        else:
            batches, prompts, count = self.held_out(), None, None
        draw = self.draw_of(request, prompts, count)
        images = self._draw(draw, batches)
        if not images:
            raise GenerationError(self._nothing_to_draw(request))
        captions = list(draw.prompts) or [c for batch in batches for c in batch["captions"]]
        histories = [h for batch in batches for h in batch.get("histories", [])]
        return [Generated(image, captions[i] if i < len(captions) else "", draw.seed, i,
                          self.weights if step is None else step, self.family_name, self.job.metadata.name,
                          histories[i] if i < len(histories) else None)
                for i, image in enumerate(images)]

    def draw_samples(self, samples: list, seed: int) -> list:
        """One image (a video family: one Clip) per sample of the job's own layout (a caption, a
        captioned clip, an edit pair with its controls, a user with a history), sample i drawn with
        seed + i, so the same weights always draw the same: what `kubetune evaluate` scores against
        each sample's own image."""
        images = []
        for i, sample in enumerate(samples):
            batches = [batch for _, batch in ordered_batches(self.family.make_dataset([sample], False), 1,
                                                              self.family.collate)]
            # the sample's own caption, not the job's prompts
            drawn = self._draw(self.draw_of(Request(), prompts=[], count=1, seed=seed + i), batches)
            if len(drawn) != 1:
                raise GenerationError(f"{self.family_name} drew {len(drawn)} images for one sample "
                                      f"({getattr(sample, 'path', sample)}); expected one")
            images.append(drawn[0] if isinstance(drawn[0], Clip) else drawn[0].convert("RGB"))
        return images

    def held_out_if_needed(self) -> list[dict]:
        """Prompts given: the held-out samples where the data set is on this machine, for a family that
        reads inputs besides the prompt (PMG's users' histories, an image-to-video model's first frames);
        an S3 data set is not fetched for them."""
        return self.held_out() if Path(self.spec.data.uri).exists() else []

    def _draw(self, draw: Draw, batches: list[dict]) -> list:
        family = self.family
        sample = family.sample_base_images if self.weights == "base" else family.sample_images
        with torch.no_grad(), family.frozen_on_device():
            return sample(family.trainable_module, batches, draw)

    def _nothing_to_draw(self, request: Request) -> str:
        if request.prompts:
            return (f"{self.family_name} drew nothing from --prompt alone: it also reads the job's held-out samples "
                    f"(spec.data.uri {self.spec.data.uri}), which are not on this machine; copy them here, or "
                    "leave out --prompt to draw the job's own")
        return (f"nothing to draw: the job has no spec.validation.prompts and no samples reachable under "
                f"spec.data.uri {self.spec.data.uri}; give --prompt (edit families: --prompt with --control)")


def grid_of(rows: list[tuple[str, list]]) -> Any:
    """Labelled rows of images, one per (label, images): the label in a band left of its row."""
    from PIL import Image, ImageDraw

    width, height = rows[0][1][0].size
    band = max(48, 7 * max(len(label) for label, _ in rows) + 8)
    columns = max(len(images) for _, images in rows)
    grid = Image.new("RGB", (band + columns * width, len(rows) * height), "white")
    draw = ImageDraw.Draw(grid)
    for r, (label, images) in enumerate(rows):
        draw.text((4, r * height + height // 2 - 5), label, fill="black")
        for c, image in enumerate(images):
            grid.paste(image.convert("RGB").resize((width, height)), (band + c * width, r * height))
    return grid


def save_images(generated: list[Generated], out: Path) -> list[Path]:
    """Each image as <step>-<index>.png with its metadata in PNG text chunks; `out` exists."""
    from PIL.PngImagePlugin import PngInfo

    written = []
    for item in generated:
        info = PngInfo()
        for key, value in item.metadata().items():
            info.add_itxt(key, value)
        path = out / f"{step_name(item.step)}-{item.index}.png"
        item.image.save(path, pnginfo=info)
        written.append(path)
    return written


def save_grid(rows: list[list[Generated]], out: Path) -> Path:
    """grid.png: one image per row when there is one row, else labelled rows (base, then the trained)."""
    if len(rows) == 1:
        grid = image_grid([item.image for item in rows[0]])
    else:
        grid = grid_of([(step_name(items[0].step), [item.image for item in items]) for items in rows])
    path = out / "grid.png"
    grid.save(path)
    return path


def step_name(step: int | str) -> str:
    return f"step-{step}" if isinstance(step, int) else step
