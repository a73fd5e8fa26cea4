"""Wan trains on its tiny models (captioned images as 1-frame clips): the default tiny model has Wan
2.2 A14B's two experts, and one run per lone expert shows the chosen expert alone trains, on its
noise levels, says so in the log and in the LoRA file's metadata, and that file loads whole into
WanPipeline's expert (the low-noise one with load_into_transformer_2=True); FSDP over two processes
trains both (the default); TI2V-5B (48-channel VAE, a timestep per token) trains too; image-to-video
(Wan 2.2 I2V A14B, Wan 2.1 I2V with its CLIP states) trains on the first frame as condition, built
as WanImageToVideoPipeline builds it, and loads whole there; TI2V-5B image-to-video (the condition
in the first latent frame) trains on clips and loads whole; bad input is refused naming the field
before anything is written."""
from __future__ import annotations

import io
import json

import pytest
import torch
from safetensors import safe_open

from kubetune_trainer.families.wan import LOW_NOISE_FILE, METADATA_KEY, write_tiny_wan
from tests.trainer.conftest import family_job, run_dir, run_trainer, run_trainer_expecting_failure

pytestmark = pytest.mark.slow

FAMILY, LAYOUT = "wan", "captions"
HIGH_NOISE_FILE = "pytorch_lora_weights.safetensors"


@pytest.fixture(scope="module")
def variant(tmp_path_factory):
    """variant(name): a tiny Wan model of that layout (write_tiny_wan's variants), written once."""
    made = {}

    def make(name: str):
        if name not in made:
            made[name] = write_tiny_wan(tmp_path_factory.mktemp(f"wan-{name}"), seed=0, variant=name)
        return made[name]
    return make


def transformer_output(transformer) -> torch.Tensor:
    """One 1-frame 4x4 latent and a 512-token caption (width 16) through a tiny expert; Wan 2.1 I2V's
    also reads 17 CLIP tokens (width 16) ahead of the caption."""
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn(1, transformer.config.in_channels, 1, 4, 4, generator=generator)
    image = torch.randn(1, 17, 16, generator=generator) if transformer.config.image_dim else None
    with torch.no_grad():
        return transformer(latents, torch.tensor([500.0]), torch.randn(1, 512, 16, generator=generator), image,
                           return_dict=False)[0]


def expert_of(file) -> str:
    with safe_open(str(file), "pt") as opened:
        return opened.metadata()[METADATA_KEY]


def assert_lora_loads_whole_and_changes_the_expert(model, run, file: str, component: str):
    """Every tensor of `file` lands in the pipeline's `component`, equal, nothing left out, and only
    that expert's output changes."""
    from diffusers import DiffusionPipeline
    from diffusers.utils import convert_unet_state_dict_to_peft
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    saved = convert_unet_state_dict_to_peft({key.removeprefix("transformer."): value
                                             for key, value in load_file(run / file).items()})
    assert saved and all(key.startswith("blocks.") for key in saved), sorted(saved)[:3]
    # (WanImageToVideoPipeline pads a LoRA without Wan 2.1 I2V's image projections with zeros: ours has them,
    # so the keys below would differ if it did.)
    pipeline = DiffusionPipeline.from_pretrained(model)  # WanPipeline, or WanImageToVideoPipeline
    others = [name for name in ("transformer", "transformer_2")
              if name != component and getattr(pipeline, name, None) is not None]
    before = {name: transformer_output(getattr(pipeline, name)) for name in (component, *others)}
    pipeline.load_lora_weights(run, weight_name=file, **({"load_into_transformer_2": True}
                                                          if component == "transformer_2" else {}))
    expert = getattr(pipeline, component)
    [adapter] = expert.peft_config
    loaded = get_peft_model_state_dict(expert, adapter_name=adapter)
    assert loaded.keys() == saved.keys(), sorted(loaded.keys() ^ saved.keys())[:4]
    assert all(torch.equal(loaded[key], saved[key].to(loaded[key].dtype)) for key in saved)
    assert (transformer_output(expert) - before[component]).abs().max() > 1e-4
    for name in others:
        assert torch.equal(transformer_output(getattr(pipeline, name)), before[name]), f"{name} changed too"


@pytest.fixture(scope="module")
def expert_runs(variant, tiny_dataset, tmp_path_factory):
    """One 2-step run per lone expert of the two-expert tiny model: (folder, stderr). Both experts
    train in the FSDP test."""
    runs = {}
    for choice in ("high-noise", "low-noise"):
        tmp = tmp_path_factory.mktemp(choice)
        manifest = family_job(FAMILY, LAYOUT, variant("a14b"), tiny_dataset(LAYOUT), tmp / "out",
                              model={"experts": choice})
        runs[choice] = (run_dir(tmp / "out"), run_trainer(manifest, tmp).stderr)
    return runs


@pytest.mark.parametrize("choice, files", [("high-noise", {HIGH_NOISE_FILE: "transformer"}),
                                           ("low-noise", {LOW_NOISE_FILE: "transformer_2"})])
def test_the_chosen_expert_alone_trains_says_so_and_its_lora_loads_whole_into_its_expert_only(
        choice, files, expert_runs, variant):
    run, stderr = expert_runs[choice]
    label = {"transformer": "high-noise", "transformer_2": "low-noise"}
    assert f"wan: training {choice} ({', '.join(files.values())})" in stderr, stderr[-2000:]
    written = {path.name for path in run.glob("*.safetensors")}
    assert written == set(files), written
    for file, component in files.items():
        assert expert_of(run / file) == label[component]
        assert_lora_loads_whole_and_changes_the_expert(variant("a14b"), run, file, component)


def test_a_lone_expert_trains_on_its_own_noise_levels_and_both_route_each_sample_to_its_expert(variant, tiny_dataset):
    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.families import family_for
    from kubetune_trainer.training.randomness import SampleRandom

    keys = [(0, index) for index in range(64)]
    drawn = {}
    for choice in ("high-noise", "low-noise", "both"):
        manifest = family_job(FAMILY, LAYOUT, variant("a14b"), tiny_dataset(LAYOUT), "/unused",
                              model={"experts": choice})
        family = family_for(FAMILY)(TrainingJob.model_validate(manifest).spec, torch.device("cpu"), torch.float32)
        sigmas = family.draw_sigmas(SampleRandom.for_keys(3, keys, 0))
        drawn[choice] = sigmas, family.routes(sigmas)
    high, low, both = (drawn[choice][0] for choice in ("high-noise", "low-noise", "both"))
    assert high.min() >= 0.875 and low.max() < 0.875, (high.min(), low.max())
    routes = drawn["both"][1]
    assert torch.equal(routes["transformer"], both >= 0.875)
    assert torch.equal(routes["transformer_2"], ~routes["transformer"])
    assert routes["transformer"].any() and routes["transformer_2"].any(), "64 draws reach both sides of 0.875"


def test_noise_levels_are_shifted_by_the_folder_s_scheduler_config_and_validation_samples_with_it(
        variant, tiny_dataset, tmp_path):
    """Wan 2.2 TI2V-5B's published scheduler config shifts by 5.0, Wan 2.1's and 2.2 A14B's by 3.0: the
    trainer draws by whatever the folder's config says (a changed one included), and the pipeline that
    renders validation clips gets that very scheduler."""
    import shutil

    from kubetune_api.spec import TrainingJob
    from kubetune_trainer.families import family_for
    from kubetune_trainer.training.flow_matching import sample_sigmas, shifted
    from kubetune_trainer.training.randomness import SampleRandom

    def family(model):
        manifest = family_job(FAMILY, LAYOUT, model, tiny_dataset(LAYOUT), "/unused")
        return family_for(FAMILY)(TrainingJob.model_validate(manifest).spec, torch.device("cpu"), torch.float32)

    def draws():
        return SampleRandom.for_keys(3, [(0, index) for index in range(64)], 0)

    unshifted = sample_sigmas(draws())
    changed = shutil.copytree(variant("ti2v-5b"), tmp_path / "ti2v-5b-shift-8")
    config_file = changed / "scheduler" / "scheduler_config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "flow_shift": 8.0}))
    for model, shift in ((variant("ti2v-5b"), 5.0), (variant("a14b"), 3.0), (changed, 8.0)):
        wan = family(model)
        assert wan.scheduler.config.flow_shift == shift
        torch.testing.assert_close(wan.draw_sigmas(draws()), shifted(unshifted, shift))  # both experts: all of [0, 1]
        assert wan.pipeline({}).scheduler.config.flow_shift == shift, "validation samples on the same schedule"


def test_the_experts_module_runs_each_expert_on_its_samples_and_an_idle_one_on_a_sample_times_zero(variant):
    """What keeps processes in step when their samples go to different experts: an expert without samples
    still runs (on one) and every trained weight gets a gradient, zero for the idle expert."""
    from diffusers import WanPipeline

    from kubetune_trainer.families.wan import Experts

    pipeline = WanPipeline.from_pretrained(variant("a14b"))
    experts = Experts({"transformer": pipeline.transformer, "transformer_2": pipeline.transformer_2})
    generator = torch.Generator().manual_seed(0)
    latents, text = torch.randn(3, 16, 1, 4, 4, generator=generator), torch.randn(3, 512, 16, generator=generator)
    timestep = torch.tensor([900.0, 100.0, 950.0])
    high = torch.tensor([True, False, True])
    routed = experts({"transformer": high, "transformer_2": ~high}, latents, timestep, text)
    with torch.no_grad():
        alone = {name: getattr(experts, name)(latents, timestep, text, return_dict=False)[0] for name in experts.names}
    torch.testing.assert_close(routed[high], alone["transformer"][high])
    torch.testing.assert_close(routed[~high], alone["transformer_2"][~high])
    everyone, no_one = torch.ones(3, dtype=torch.bool), torch.zeros(3, dtype=torch.bool)
    everyone_high = experts({"transformer": everyone, "transformer_2": no_one}, latents, timestep, text)
    everyone_high.square().mean().backward()
    idle = [p.grad for p in experts.transformer_2.parameters()]
    assert all(grad is not None and not grad.any() for grad in idle), "the idle expert ran, contributing zero"
    assert any(p.grad.any() for p in experts.transformer.parameters())


@pytest.mark.parametrize("name", ["ti2v-5b"])  # Wan 2.1's one expert trains in the image-to-video test
def test_one_expert_models_train_and_their_lora_loads_whole(name, variant, tiny_dataset, tmp_path):
    """Wan 2.2 TI2V-5B: 48 latent channels, a 16x VAE, a timestep per token."""
    manifest = family_job(FAMILY, LAYOUT, variant(name), tiny_dataset(LAYOUT), tmp_path / "out")
    stderr = run_trainer(manifest, tmp_path).stderr
    assert "wan: training whole (transformer)" in stderr, stderr[-2000:]
    run = run_dir(tmp_path / "out")
    assert expert_of(run / HIGH_NOISE_FILE) == "whole"
    assert_lora_loads_whole_and_changes_the_expert(variant(name), run, HIGH_NOISE_FILE, "transformer")


@pytest.fixture(scope="module")
def clip_run(variant, tiny_dataset, tmp_path_factory):
    """Wan 2.1 on the video-captions layout's H.264 clips, 5 frames a sample, validating at step 2 with
    two prompts: (run folder, stderr)."""
    tmp = tmp_path_factory.mktemp("clips")
    manifest = family_job(FAMILY, "video-captions", variant("2.1"), tiny_dataset("video-captions"), tmp / "out",
                          data={"frames": 5}, validation={"everySteps": 2, "prompts": ["a red cube", "a blue ball"],
                                                          "numInferenceSteps": 2})
    return run_dir(tmp / "out"), run_trainer(manifest, tmp).stderr


def test_real_mp4_clips_train_on_the_vae_s_time_axis_and_the_lora_loads_whole(clip_run, variant):
    """The video-captions layout's H.264 clips, 5 frames a sample (two latent frames), into Wan 2.1's
    one expert (clips() hands them to the VAE as [B, C, 5, H, W])."""
    run, stderr = clip_run
    assert "wan: training whole (transformer)" in stderr, stderr[-2000:]
    assert_lora_loads_whole_and_changes_the_expert(variant("2.1"), run, HIGH_NOISE_FILE, "transformer")


def test_validation_renders_each_prompt_as_an_h264_mp4_and_an_animated_gif_tensorboard_plays(clip_run):
    """spec.data.frames frames per validation clip: the .mp4 decodes to them, the GIF preview and the
    TensorBoard image summary (a GIF too) animate them, at the run's 32 px."""
    import av
    from PIL import Image
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = clip_run
    folder = run / "samples" / "step-0000002"
    assert sorted(p.name for p in folder.iterdir()) == ["0.gif", "0.mp4", "1.gif", "1.mp4"]
    for number in (0, 1):
        with av.open(str(folder / f"{number}.mp4")) as container:
            stream = container.streams.video[0]
            assert stream.codec_context.name == "h264"
            decoded = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        assert len(decoded) == 5 and decoded[0].shape == (32, 32, 3)
        with Image.open(folder / f"{number}.gif") as preview:
            assert preview.is_animated and preview.n_frames == 5 and preview.size == (32, 32)
    events = EventAccumulator(str(run / "logs"), size_guidance={"images": 0}).Reload()
    for number in (0, 1):
        base, summary = events.Images(f"samples/{number}")  # step 0 (the base model) and the final step
        assert (base.step, summary.step) == (0, 2) and summary.encoded_image_string.startswith(b"GIF8")
        with Image.open(io.BytesIO(summary.encoded_image_string)) as played:
            assert played.n_frames == 5


@pytest.mark.parametrize("name, experts, files", [
    ("i2v-a14b", "low-noise", {LOW_NOISE_FILE: "transformer_2"}),   # Wan 2.2 I2V A14B: no image encoder
    ("i2v-2.1", None, {HIGH_NOISE_FILE: "transformer"}),             # Wan 2.1 I2V: CLIP states too
])
def test_image_to_video_trains_on_the_first_frame_as_condition_samples_from_held_out_frames_and_loads_whole(
        name, experts, files, variant, tiny_dataset, tmp_path):
    manifest = family_job(FAMILY, LAYOUT, variant(name), tiny_dataset(LAYOUT), tmp_path / "out",
                          model={"experts": experts},
                          validation={"everySteps": 2, "heldOutFraction": 0.25, "prompts": ["a red cube"],
                                      "numInferenceSteps": 2})
    stderr = run_trainer(manifest, tmp_path).stderr
    assert "image-to-video (first frame as condition)" in stderr, stderr[-2000:]
    run = run_dir(tmp_path / "out")
    assert (run / "samples" / "step-0000002" / "0.png").is_file(), "a held-out first frame, animated by one prompt"
    assert {path.name for path in run.glob("*.safetensors")} == set(files)
    for file, component in files.items():
        assert expert_of(run / file) == (experts or "whole")
        assert_lora_loads_whole_and_changes_the_expert(variant(name), run, file, component)


def test_ti2v_5b_image_to_video_trains_clips_past_their_first_frame_samples_and_loads_whole(
        variant, tiny_dataset, tmp_path):
    """TI2V-5B as a WanImageToVideoPipeline: the condition is the first latent frame (48 channels in),
    trained on 5-frame clips; validation animates a held-out first frame; the LoRA loads whole."""
    name = "i2v-ti2v-5b"
    manifest = family_job(FAMILY, "video-captions", variant(name), tiny_dataset("video-captions"), tmp_path / "out",
                          data={"frames": 5},
                          validation={"everySteps": 2, "heldOutFraction": 0.25, "prompts": ["a red cube"],
                                      "numInferenceSteps": 2})
    stderr = run_trainer(manifest, tmp_path).stderr
    assert "wan: training whole (transformer)" in stderr and "image-to-video (first frame as condition)" in stderr, \
        stderr[-2000:]
    run = run_dir(tmp_path / "out")
    assert (run / "samples" / "step-0000002" / "0.mp4").is_file(), "a held-out first frame, animated by one prompt"
    assert expert_of(run / HIGH_NOISE_FILE) == "whole"
    assert_lora_loads_whole_and_changes_the_expert(variant(name), run, HIGH_NOISE_FILE, "transformer")


def test_ti2v_5b_s_condition_and_timesteps_are_the_ones_wan_image_to_video_pipeline_prepares(variant):
    """The first frame alone through the VAE, normalised, in place of the first latent frame, and timestep 0
    on that frame's tokens: what WanImageToVideoPipeline with expand_timesteps hands its transformer."""
    from diffusers import WanImageToVideoPipeline

    from kubetune_trainer.families.wan import first_latent_mask, normalised

    pipeline = WanImageToVideoPipeline.from_pretrained(variant("i2v-ti2v-5b"))
    assert pipeline.config.expand_timesteps and pipeline.transformer.config.in_channels == 48
    generator = torch.Generator().manual_seed(0)
    clip = torch.rand(1, 3, 5, 32, 32, generator=generator) * 2 - 1
    noisy, expected, pipeline_mask = pipeline.prepare_latents(clip[:, :, 0], 1, 48, 32, 32, 5, torch.float32,
                                                              torch.device("cpu"), generator)
    with torch.no_grad():
        condition = normalised(pipeline.vae.encode(clip[:, :, :1]).latent_dist.mode(), pipeline.vae.config)
    torch.testing.assert_close(condition, expected)
    mask = first_latent_mask(noisy)
    torch.testing.assert_close(mask, pipeline_mask)
    tokens = mask[0, 0][:, ::2, ::2].flatten()
    assert tokens.tolist() == [0.0] + [1.0] * (len(tokens) - 1), "one 2x2-patch token per latent frame here"


@pytest.mark.parametrize("frames", [1, 5])
def test_the_first_frame_condition_is_the_one_wan_image_to_video_pipeline_prepares(frames, variant):
    """Mask and condition latents as WanImageToVideoPipeline.prepare_latents makes them from the first frame
    (a 1-frame clip, an image, is its own condition; a clip's later frames do not enter it)."""
    from diffusers import WanImageToVideoPipeline

    from kubetune_trainer.families.wan import first_frame_condition, first_frame_mask, normalised

    pipeline = WanImageToVideoPipeline.from_pretrained(variant("i2v-a14b"))
    generator = torch.Generator().manual_seed(0)
    clip = torch.rand(1, 3, frames, 32, 32, generator=generator) * 2 - 1
    _, expected = pipeline.prepare_latents(clip[:, :, 0], 1, 16, 32, 32, frames, torch.float32, torch.device("cpu"),
                                           generator)
    with torch.no_grad():
        latents = normalised(pipeline.vae.encode(first_frame_condition(clip)).latent_dist.mode(), pipeline.vae.config)
    mask = first_frame_mask(1, frames, 4, 4)
    assert mask.shape == (1, 4, (frames - 1) // 4 + 1, 4, 4)
    torch.testing.assert_close(torch.cat([mask, latents], dim=1), expected)


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_two_processes_train_both_experts_by_default_and_publish_each_one_s_lora(
        strategy, variant, tiny_dataset, tmp_path, capfd):
    """One sample per process: the two processes' samples often go to different experts, each process
    running the other expert on its sample times zero (else FSDP's all-gathers or DDP's reducer hang)."""
    from kubetune_api.manifest import parse_manifest
    from kubetune_trainer.process.start import launch_local

    manifest = family_job(FAMILY, LAYOUT, variant("a14b"), tiny_dataset(LAYOUT), tmp_path / "out",
                          distributed={"strategy": strategy}, training={"batchSize": 1})
    assert launch_local(parse_manifest(manifest), nproc=2) == 0
    stderr = capfd.readouterr().err
    assert f"2 process(es) ({strategy})" in stderr and "wan: training both (transformer, transformer_2)" in stderr
    run = run_dir(tmp_path / "out")
    assert (run / "checkpoint-2" / "manifest.json").is_file()
    for file, component, expert in ((HIGH_NOISE_FILE, "transformer", "high-noise"),
                                    (LOW_NOISE_FILE, "transformer_2", "low-noise")):
        assert expert_of(run / file) == expert
        assert_lora_loads_whole_and_changes_the_expert(variant("a14b"), run, file, component)


@pytest.mark.parametrize("name, changes, message", [
    ("2.1", {"model": {"experts": "low-noise"}},
     "spec.model.experts: 'low-noise' needs a two-expert model (Wan 2.2 A14B), but {model}/model_index.json names "
     "no transformer_2 with a boundary_ratio; remove spec.model.experts"),
    ("ti2v-5b", {"data": {"resolution": 48}},
     "spec.data.resolution: 48 is not a multiple of 32, which this wan model needs (its VAE's 16x times its 2x2 "
     "patches); use 32 or 64"),
])
def test_a_choice_the_model_cannot_take_is_refused_in_one_line_before_anything_is_written(
        name, changes, message, variant, tiny_dataset, tmp_path):
    manifest = family_job(FAMILY, LAYOUT, variant(name), tiny_dataset(LAYOUT), tmp_path / "out", **changes)
    stderr = run_trainer_expecting_failure(manifest, tmp_path)
    assert message.format(model=variant(name)) in stderr, stderr[-2000:]
    assert "Traceback" not in stderr
    assert not (tmp_path / "out").exists(), "refused before the run wrote anything"


@pytest.mark.parametrize("data, given", [({"layout": "captions"}, "images (1 frame each)"),
                                         ({"layout": "video-captions", "frames": [1, 9]}, "spec.data.frames 1")])
def test_ti2v_5b_image_to_video_refuses_samples_with_no_frame_past_the_condition(data, given):
    """(Raised where Wan's constructor raised before: before any model is loaded.)"""
    from types import SimpleNamespace

    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families.wan import check_latent_condition_frames

    spec = SimpleNamespace(data=SimpleNamespace(frames=data.get("frames")))
    with pytest.raises(ConfigError) as refused:
        check_latent_condition_frames(spec, {"scale_factor_temporal": 4})
    assert str(refused.value) == (
        f"spec.data.frames: TI2V-5B image-to-video trains the frames after the first (the first is its condition), "
        f"but {given} leave none; train on clips (layout video-captions) of at least 5 frames, or use its "
        "WanPipeline folder (text-to-video)")
    check_latent_condition_frames(SimpleNamespace(data=SimpleNamespace(frames=[5, 9])), {"scale_factor_temporal": 4})


def test_the_api_refuses_experts_for_another_family_and_a_size_off_the_16_grid():
    from pydantic import ValidationError

    from kubetune_api.spec import TrainingJobSpec  # its validation enforces the webhook's rules too

    def spec(family, **model):
        return {"model": {"family": family, "pretrained": "/m", **model}, "training": {"maxSteps": 1},
                "data": {"layout": "captions", "uri": "/d", "resolution": 40}, "checkpoints": {"uri": "/c"}}

    with pytest.raises(ValidationError, match="spec.model.experts is not honoured by family z-image"):
        TrainingJobSpec.model_validate(spec("z-image", experts="both"))
    with pytest.raises(ValidationError, match="spec.data.resolution must be a multiple of 16 for family wan"):
        TrainingJobSpec.model_validate(spec("wan"))


def test_image_batches_and_video_batches_reach_the_vae_as_clips():
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.families.wan import clips

    assert clips(torch.zeros(2, 3, 32, 48)).shape == (2, 3, 1, 32, 48), "an image is a 1-frame clip"
    video = torch.arange(2 * 5 * 3, dtype=torch.float32).view(2, 5, 3, 1, 1).expand(2, 5, 3, 8, 8)
    assert torch.equal(clips(video)[:, :, 4], video[:, 4]), "[B, F, C, H, W] -> [B, C, F, H, W]"
    with pytest.raises(ConfigError, match="clips of 4 frames; wan takes 4k \\+ 1 frames"):
        clips(torch.zeros(1, 4, 3, 8, 8))


@pytest.mark.parametrize("component, published", [
    ("transformer", 14.29e9),    # Wan2.1-T2V-14B = each Wan2.2-T2V-A14B expert
    ("text_encoder", 5.68e9),    # umt5-xxl's encoder
    ("vae", 0.127e9),            # Wan 2.1's causal 3D VAE
])
def test_the_reference_architecture_has_the_published_sizes(component, published):
    from kubetune_trainer.families.components import build
    from kubetune_trainer.models.reference_models import architecture

    with torch.device("meta"):
        model = build(architecture(FAMILY)[component])
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(published, rel=0.01)


def test_the_ti2v_5b_configs_have_the_published_sizes():
    from diffusers import AutoencoderKLWan, WanTransformer3DModel

    from kubetune_trainer.families.wan import WAN22_VAE, WAN_5B_TRANSFORMER

    with torch.device("meta"):
        transformer = WanTransformer3DModel.from_config(WAN_5B_TRANSFORMER)
        vae = AutoencoderKLWan.from_config(WAN22_VAE)
    assert sum(p.numel() for p in transformer.parameters()) == pytest.approx(5.0e9, rel=0.01)
    assert sum(p.numel() for p in vae.parameters()) == pytest.approx(0.70e9, rel=0.05)
    assert json.loads(json.dumps(WAN22_VAE))["z_dim"] == 48


def test_the_planner_builds_what_the_expert_choice_trains(tmp_path):
    """`kubetune plan` on the published configs: one 14B expert, or both of a two-expert folder in one
    trained module (twice the weights and the LoRA); a choice the folder cannot take is refused."""
    import shutil

    from kubetune_api.spec import TrainingJobSpec
    from kubetune_trainer.errors import ConfigError
    from kubetune_trainer.planning.models import load_models
    from kubetune_trainer.models.reference_models import write_config_only

    one = write_config_only(FAMILY, tmp_path / "wan2.1")
    two = shutil.copytree(one, tmp_path / "wan2.2-a14b")
    shutil.copytree(two / "transformer", two / "transformer_2")
    index = json.loads((two / "model_index.json").read_text())
    (two / "model_index.json").write_text(json.dumps({**index, "transformer_2": ["diffusers", "WanTransformer3DModel"],
                                                      "boundary_ratio": 0.875}))

    def planned(folder, experts=None):
        spec = TrainingJobSpec.model_validate({
            "model": {"family": FAMILY, "pretrained": str(folder), "experts": experts},
            "adapter": {"rank": 32}, "training": {"maxSteps": 1},
            "data": {"layout": LAYOUT, "uri": "/d", "resolution": [832, 480]}, "checkpoints": {"uri": "/c"}})
        trained = load_models(spec).trained_module
        return (sum(p.numel() for p in trained.parameters() if not p.requires_grad),
                sum(p.numel() for p in trained.parameters() if p.requires_grad))

    frozen, lora = planned(one)
    assert frozen == pytest.approx(14.29e9, rel=0.01) and lora > 0
    assert planned(two, "low-noise") == (frozen, lora)
    assert planned(two) == planned(two, "both") == (2 * frozen, 2 * lora)
    with pytest.raises(ConfigError, match="spec.model.experts: 'both' needs a two-expert model"):
        planned(one, "both")
