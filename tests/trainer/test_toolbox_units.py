"""The training toolbox in isolation: optimizers, schedules, buckets, the embedding cache, edit pairs."""
from __future__ import annotations

import random

import pytest
import torch
from PIL import Image

from kubetune_api.spec_training import TrainingSpec
from kubetune_trainer.data.buckets import bucket_sizes, nearest_bucket
from kubetune_trainer.data.cache import EmbeddingCache, Encoder, LocalStore
from kubetune_trainer.data.captions import CaptionedImage, CaptionsDataset, collate
from kubetune_trainer.data.edit_pairs import EditPairsDataset, read_edit_pairs
from kubetune_trainer.data.screening import Screen
from kubetune_trainer.data.images import ImageTransform
from kubetune_trainer.data.sampler import Batching, epoch_steps, steps_per_epoch
from kubetune_trainer.errors import ConfigError
from kubetune_trainer.training.ema import EMA
from kubetune_trainer.training.optim import build_lr_scheduler, build_optimizer, lr_multiplier, set_optimizer_mode
from kubetune_trainer.data.tiny_data import write_tiny_data


def training(**fields) -> TrainingSpec:
    return TrainingSpec.model_validate({"maxSteps": 10, **fields})


OPTIMIZERS = ["adamw", "prodigy", "lion", "sgd", "schedulefree-adamw"]
SCHEDULERS = ["constant", "linear", "cosine", "cosine-restarts", "step", "plateau"]


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_every_optimizer_takes_a_step_that_changes_the_weights(optimizer):
    spec = training(optimizer=optimizer, learningRate=1.0 if optimizer == "prodigy" else 1e-2)
    weight = torch.nn.Parameter(torch.ones(4))
    opt = build_optimizer([weight], spec)
    scheduler = build_lr_scheduler(opt, spec, total_steps=10)
    set_optimizer_mode(opt, training=True)
    (weight ** 2).sum().backward()
    opt.step()
    scheduler.step()
    set_optimizer_mode(opt, training=False)
    assert not torch.equal(weight.detach(), torch.ones(4))


@pytest.mark.parametrize("kind", SCHEDULERS)
def test_every_schedule_steps_and_round_trips_its_state(kind):
    spec = training(lrScheduler=kind, lrStepSize=2, lrGamma=0.5, lrPlateauPatience=1, lrCycles=2)
    weight = torch.nn.Parameter(torch.ones(1))
    opt = build_optimizer([weight], spec)
    scheduler = build_lr_scheduler(opt, spec, total_steps=10)
    for _ in range(3):
        opt.step()
        scheduler.step()
        if kind == "plateau":
            scheduler.observe(1.0)  # never improves after the first
    restored = build_lr_scheduler(build_optimizer([weight], spec), spec, total_steps=10)
    restored.load_state_dict(scheduler.state_dict())
    assert restored.get_last_lr() == scheduler.get_last_lr()


SCHEDULE_VALUES = [
    # (kind, step, extra, expected multiplier)
    ("step", 1, {"step_size": 2, "gamma": 0.5}, 1.0),
    ("step", 4, {"step_size": 2, "gamma": 0.5}, 0.25),
    ("cosine-restarts", 0, {"cycles": 2}, 1.0),
    ("cosine-restarts", 5, {"cycles": 2}, 1.0),  # the second cycle starts at the peak again
    ("cosine-restarts", 10, {"cycles": 2}, 0.0),
    ("cosine", 5, {}, 0.5),
]


@pytest.mark.parametrize("kind,step,extra,expected", SCHEDULE_VALUES)
def test_schedules_follow_their_shape(kind, step, extra, expected):
    assert lr_multiplier(step, kind, 0, 10, **extra) == pytest.approx(expected, abs=1e-9)


def test_plateau_decays_after_patience_losses_without_improvement():
    spec = training(lrScheduler="plateau", lrGamma=0.5, lrPlateauPatience=2, learningRate=1.0)
    opt = build_optimizer([torch.nn.Parameter(torch.ones(1))], spec)
    scheduler = build_lr_scheduler(opt, spec, total_steps=10)
    for loss in (1.0, 0.9, 0.95, 0.95):
        scheduler.observe(loss)
        scheduler.step()
    assert scheduler.get_last_lr()[0] == pytest.approx(0.5)


def test_8bit_adamw_on_cpu_is_refused_naming_the_option():
    with pytest.raises(ConfigError, match="spec.training.optimizer: adamw8bit needs a CUDA GPU with bitsandbytes"):
        build_optimizer([torch.nn.Parameter(torch.ones(1))], training(optimizer="adamw8bit"))


def test_ema_follows_the_weights_and_swaps_back_exactly():
    weight = torch.nn.Parameter(torch.zeros(3))
    ema = EMA([("weight", weight)], decay=0.5)
    with torch.no_grad():
        weight.fill_(2.0)
    ema.update()
    trained = weight.detach().clone()
    ema.swap()
    assert torch.allclose(weight.detach(), torch.ones(3))
    ema.swap()
    assert torch.equal(weight.detach(), trained)


# --- buckets ------------------------------------------------------------------------------------

def test_buckets_keep_the_pixel_count_and_pick_the_nearest_ratio():
    sizes = bucket_sizes(1024)
    assert (1024, 1024) in sizes
    assert all(abs(w * h / 1024 ** 2 - 1) < 0.15 and w % 64 == 0 and h % 64 == 0 for w, h in sizes)
    wide = sizes[nearest_bucket(1920, 1080, sizes)]
    assert wide[0] > wide[1]


@pytest.mark.parametrize("world", [1, 2, 3])
def test_bucketed_steps_never_mix_buckets_and_every_rank_trains_its_steps_bucket(world):
    rng = random.Random(0)
    groups = [rng.randrange(3) for _ in range(40)]
    steps = epoch_steps(40, 2 * world, seed=5, epoch=1, groups=groups)
    assert len(steps) == steps_per_epoch(40, 2 * world, groups)
    batching = Batching.fresh(2, world, 1)
    for step in steps:
        shares = [batching.micro_batch(step, 0, rank) for rank in range(world)]
        assert len({groups[i] for share in shares for _, i in share}) == 1
    seen = [i for step in steps for _, i in step]
    assert len(seen) == len(set(seen))


def test_bucketed_captions_stack_into_one_shape_per_batch(tmp_path):
    samples = []
    for i, (w, h) in enumerate([(64, 32), (32, 64), (64, 32), (32, 64), (40, 40), (40, 40)]):
        Image.new("RGB", (w, h), (i * 30, 0, 0)).save(tmp_path / f"{i}.png")
        samples.append(CaptionedImage(tmp_path / f"{i}.png", f"image {i}"))
    dataset = CaptionsDataset(samples, ImageTransform(32), 0.0, seed=0, bucketing=True)
    shapes = set()
    for batch in epoch_steps(len(dataset), 2, seed=0, epoch=0, groups=dataset.groups):
        pixels = collate([dataset[key] for key in batch])["pixel_values"]
        shapes.add(tuple(pixels.shape[-2:]))
    assert len(shapes) == 3, "landscape, portrait and square batches, each stacked"


# --- embedding cache ----------------------------------------------------------------------------

def counting_encoder(calls: list) -> Encoder:
    def encode(texts):
        calls.append(list(texts))
        return {"embedding": torch.tensor([[float(len(t)), float(ord(t[0]))] for t in texts])}
    return Encoder("text", "length-encoder-v1", encode)


def test_cache_is_keyed_by_content_so_a_reshuffle_keeps_pairs(tmp_path):
    calls = []
    cache = EmbeddingCache(LocalStore(tmp_path))
    first = cache.encode(counting_encoder(calls), ["a", "bbb"])["embedding"]
    again = cache.encode(counting_encoder(calls), ["bbb", "a"])["embedding"]
    assert torch.equal(again, first.flip(0))
    assert calls == [["a", "bbb"]] and (cache.hits, cache.misses) == (2, 2)


def test_cache_entries_are_per_encoder_identity_and_shared_across_instances(tmp_path):
    calls = []
    EmbeddingCache(LocalStore(tmp_path)).encode(counting_encoder(calls), ["a"])
    other_run = EmbeddingCache(LocalStore(tmp_path))
    other_run.encode(counting_encoder(calls), ["a"])
    assert other_run.hits == 1
    changed = Encoder("text", "length-encoder-v2", counting_encoder(calls).encode)
    other_run.encode(changed, ["a"])
    assert other_run.misses == 1, "another encoder identity never reads the first one's entries"


class CountingStore(LocalStore):
    def __init__(self, root):
        super().__init__(root)
        self.asked: list[str] = []

    def contains(self, key):
        self.asked.append(key)
        return super().contains(key)


def test_an_images_mirror_is_looked_up_once_per_process_but_a_captions_variants_every_time(tmp_path):
    images = Encoder("latents", "pixels-v1", lambda batch: {"latent": torch.stack([x.mean().reshape(1) for x in batch])})
    store = CountingStore(tmp_path)
    cache = EmbeddingCache(store)
    image = torch.arange(12.0).reshape(1, 3, 4)
    cache.encode(images, [image], [[image.flip(-1)]])
    assert len(store.asked) == 1, "its mirror looked up (then stored) the first time"
    cache.encode(images, [image], [[image.flip(-1)]])
    assert len(store.asked) == 1, "the mirror is a function of the image: not hashed nor looked up again"
    other_run = EmbeddingCache(store)
    assert other_run.encode(images, [image.flip(-1)])["latent"].item() == image.mean().item()
    assert other_run.hits == 1, "the mirror was stored beside the image"

    # The dropped caption "" is the same input for every sample, its variant (the full caption) is not.
    calls = []
    lengths = Encoder("text", "lengths-v1", lambda texts: calls.append(list(texts)) or
                      {"length": torch.tensor([[float(len(t))] for t in texts])})
    texts = EmbeddingCache(CountingStore(tmp_path / "text"))
    texts.encode(lengths, [""], [["a cat"]])
    texts.encode(lengths, [""], [["a dog"]])
    assert calls[-1] == ["a dog"], "a caption's variants are checked every time"


def test_cached_token_sequences_of_other_lengths_are_zero_padded_to_the_batch(tmp_path):
    def tokens(texts):  # one row per character, padded to the batch's longest with a mask
        longest = max(len(t) for t in texts)
        return {"embeds": torch.stack([torch.tensor([[float(ord(c))] for c in t.ljust(longest, "\0")]) for t in texts]),
                "mask": torch.tensor([[1] * len(t) + [0] * (longest - len(t)) for t in texts])}
    encoder = Encoder("text", "token-encoder-v1", tokens)
    cache = EmbeddingCache(LocalStore(tmp_path))
    cache.encode(encoder, ["ab", "abcd"])  # "ab" is stored padded to 4
    mixed = cache.encode(encoder, ["ab", "abc"])  # a hit (4 long) and a miss (3 long)
    assert mixed["mask"].tolist() == [[1, 1, 0, 0], [1, 1, 1, 0]]
    assert mixed["embeds"][1, :, 0].tolist() == [97.0, 98.0, 99.0, 0.0]

# --- edit pairs ---------------------------------------------------------------------------------

def test_edit_pairs_flip_together_and_control_dropout_blanks_the_control(tmp_path):
    root = write_tiny_data("edit-pairs", tmp_path, count=4, size=32)
    pairs = read_edit_pairs(root, Screen(skip_bad=False))
    assert len(pairs) == 4 and pairs[0].instruction.startswith("make the")
    flipping = EditPairsDataset(pairs, ImageTransform(32, random_flip=True), 0.0, 0.0, seed=0)
    unflipped = EditPairsDataset(pairs, ImageTransform(32), 0.0, 0.0, seed=0)
    for epoch in range(4):
        item, plain = flipping[(epoch, 0)], unflipped[(epoch, 0)]
        target_flipped = torch.equal(item["pixel_values"], plain["pixel_values"].flip(-1))
        control_flipped = torch.equal(item["control_values"], plain["control_values"].flip(-1))
        assert target_flipped == control_flipped
    dropped = EditPairsDataset(pairs, ImageTransform(32), 0.0, 1.0, seed=0)[(0, 1)]
    assert torch.count_nonzero(dropped["control_values"]) == 0


def test_missing_instruction_is_named(tmp_path):
    root = write_tiny_data("edit-pairs", tmp_path, count=2, size=32)
    (root / "training_images" / "0001.txt").unlink()
    with pytest.raises(ValueError, match="0001.png: no instruction 0001.txt next to it; fix or remove it"):
        read_edit_pairs(root, Screen(skip_bad=False))


def test_a_resumed_run_trains_with_its_specs_learning_rate_and_keeps_the_optimizer_moments():
    # Population-based training resumes a strong trial's checkpoint with a perturbed learning rate.
    from kubetune_trainer.training.optim import follow_spec_after_resume

    def build(lr, decay):
        weight = torch.nn.Parameter(torch.ones(3))
        spec = training(learningRate=lr, weightDecay=decay, lrScheduler="cosine", lrWarmupSteps=2)
        optimizer = build_optimizer([weight], spec)
        return weight, optimizer, build_lr_scheduler(optimizer, spec, 10), spec

    weight, optimizer, scheduler, _ = build(1e-3, 0.01)
    for _ in range(4):
        weight.grad = torch.full((3,), 0.5)
        optimizer.step()
        scheduler.step()
    saved = optimizer.state_dict(), scheduler.state_dict()

    weight2, optimizer2, scheduler2, spec2 = build(3e-3, 0.05)
    optimizer2.load_state_dict(saved[0])
    scheduler2.load_state_dict(saved[1])
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(scheduler.get_last_lr()[0])  # the old run's rate
    follow_spec_after_resume(optimizer2, scheduler2, spec2)
    expected = 3e-3 * lr_multiplier(4, "cosine", 2, 10)
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(expected) == scheduler2.get_last_lr()[0]
    assert optimizer2.param_groups[0]["weight_decay"] == 0.05
    assert torch.equal(optimizer2.state[weight2]["exp_avg"], optimizer.state[weight]["exp_avg"])
    scheduler2.step()  # the schedule goes on from step 5 at the new peak
    assert optimizer2.param_groups[0]["lr"] == pytest.approx(3e-3 * lr_multiplier(5, "cosine", 2, 10))
