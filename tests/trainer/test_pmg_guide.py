"""PMG as its training guide describes it: the trained parts' size at the real dimensions
(LLaMA-2-7B reading the history, SD1.5 generating), and the guide's processed data sets
(train.json / val.json of FLICKR, POG or SER) read as they are."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch

from tests.trainer.conftest import family_job, run_trainer, run_trainer_expecting_failure

pytestmark = pytest.mark.slow

LLAMA2_7B_PER_PREFIX_TOKEN = 32 * 2 * 4096   # every layer's key and value
GUIDE_DEFAULTS = {"num_image_prompt": 2, "num_prefix_prompt": 2}


def trained_parameters(prefix_projection: bool = False, prefix_hidden_size: int | None = None) -> int:
    from transformers import LlamaConfig

    from kubetune_trainer.families.pmg import PmgAdapter
    from kubetune_trainer.models.reference_models import architecture

    llama = LlamaConfig(**architecture("pmg")["language_model"].config)
    unet = architecture("pmg")["unet"].config
    with torch.device("meta"):
        adapter = PmgAdapter(llama, GUIDE_DEFAULTS["num_image_prompt"], GUIDE_DEFAULTS["num_prefix_prompt"],
                             unet["cross_attention_dim"], prefix_projection, prefix_hidden_size)
    return sum(p.numel() for p in adapter.parameters() if p.requires_grad)


def test_at_llama2_7b_and_sd15_dimensions_pmg_trains_a_few_million_parameters_not_a_billion():
    expected = (2 * 4096                                   # two image-prompt tokens
                + 2 * LLAMA2_7B_PER_PREFIX_TOKEN           # a two-token prefix for every layer's keys and values
                + 4096 * 768 + 768 + 2 * 768)              # the mapping into SD1.5's text space, and its norm
    assert trained_parameters() == expected
    print(f"PMG trained parameters at LLaMA-2-7B + SD1.5, guide defaults: {expected / 1e6:.2f}M")
    # P-Tuning v2's projection, opt-in: its last Linear alone is hidden x (layers x 2 x hidden).
    assert trained_parameters(prefix_projection=True) > 1.09e9
    assert trained_parameters(prefix_projection=True, prefix_hidden_size=64) < 25e6


def test_kubetune_plan_counts_the_same_trained_parameters(configs, planner):
    from kubetune_api.spec import TrainingJobSpec

    spec = TrainingJobSpec.model_validate({
        "model": {"family": "pmg", "pretrained": str(configs["pmg"])},
        "data": {"layout": "pmg", "uri": "/data", "resolution": 512},
        "training": {"maxSteps": 1, "batchSize": 6, "mixedPrecision": "bf16", "gradientCheckpointing": True},
        "checkpoints": {"uri": "/ck"},
    })
    assert planner.estimate(spec, 1, "ddp").trainable_parameters == trained_parameters()


def guide_form(records: list[dict]) -> list[dict]:
    """Records of kubetune's pmg form rewritten as the guide's processed_dataset/*.json has them."""
    return [{"worker_id": r["user_id"],
             "history_items_info": [{"item_id": f"{r['user_id']}-{i}", "caption": text, "image_path": r["target_image"]}
                                    for i, text in enumerate(r["history"])],
             "target_item_id": f"target-{n}",
             "target_item_info": {"item_id": f"target-{n}", "caption": r["target_caption"],
                                  "image_path": r["target_image"]},
             "worker_style": "bold colours", "num_interactions": len(r["history"])}
            for n, r in enumerate(records)]


@pytest.fixture
def guide_data(tiny_dataset, tmp_path):
    """The tiny pmg data as the guide lays it out: processed_dataset/train.json (6) and val.json (2)."""
    data = tmp_path / "FLICKR"
    shutil.copytree(tiny_dataset("pmg"), data)
    records = guide_form(json.loads((data / "data.json").read_text()))
    (data / "data.json").unlink()
    (data / "processed_dataset").mkdir()
    (data / "processed_dataset" / "train.json").write_text(json.dumps(records[:6]))
    (data / "processed_dataset" / "val.json").write_text(json.dumps(records[6:]))
    return data


def guide_job(model, data, out, **pmg) -> dict:
    return family_job("pmg", "pmg", model, data, out,
                      pmg={"trainJson": "processed_dataset/train.json", "maxSequenceLength": 32, **pmg},
                      training={"maxSteps": 2, "lrScheduler": "linear", "lrWarmupSteps": 1, "maxGradNorm": 1.0,
                                "gradientCheckpointing": True},
                      validation={"everySteps": 1})


def test_the_guides_train_and_val_files_train_and_validate_as_they_are(tiny_model, guide_data, tmp_path):
    with_val = run_trainer(guide_job(tiny_model("pmg"), guide_data, tmp_path / "with-val",
                                     valJson="processed_dataset/val.json"), tmp_path)
    steps = re.findall(r"validation at step (\d+): loss [\d.]+", with_val.stderr)
    # on val.json before the first step and at every step (the job holds nothing out of train.json)
    assert steps == ["0", "1", "2"], with_val.stderr[-3000:]


def test_a_broken_guide_record_is_named_before_training(tiny_model, guide_data, tmp_path):
    train = guide_data / "processed_dataset" / "train.json"
    records = json.loads(train.read_text())
    del records[3]["target_item_info"]["image_path"]
    train.write_text(json.dumps(records))
    stderr = run_trainer_expecting_failure(guide_job(tiny_model("pmg"), guide_data, tmp_path / "out"), tmp_path)
    assert "processed_dataset/train.json[3]" in stderr and "image_path" in stderr, stderr[-2000:]


def test_checkpointing_the_language_model_gives_the_same_gradients(tiny_model):
    from transformers import AutoModelForCausalLM

    from kubetune_api.spec_training import PmgSpec
    from kubetune_trainer.families.pmg import adapter_for, checkpoint_language_model

    folder = tiny_model("pmg") / "language_model"  # written first: writing it draws from the global RNG

    def gradients(checkpointed: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)  # the adapter starts the same both times
        language_model = AutoModelForCausalLM.from_pretrained(folder).eval()
        language_model.requires_grad_(False)
        if checkpointed:
            checkpoint_language_model(language_model)
        adapter = adapter_for(PmgSpec(numPrefixPrompt=3), language_model.config, 32)
        tokens = torch.tensor([[5, 6, 7, 8], [0, 0, 9, 10]])
        adapter(language_model, tokens, (tokens != 0).long()).square().sum().backward()
        return {name: p.grad for name, p in adapter.named_parameters()}

    plain, checkpointed = gradients(False), gradients(True)
    assert plain.keys() == checkpointed.keys() and all(g is not None for g in plain.values())
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], msg=lambda m, name=name: f"{name}: {m}")
