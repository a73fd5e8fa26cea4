"""What the Qwen-Image families' tests check alike: a run's LoRA file loads whole into the family's
own pipeline, and changes its transformer's output."""
from __future__ import annotations

from pathlib import Path

import torch


def transformer_output(transformer, references: int = 0) -> torch.Tensor:
    """The tiny transformer's output on fixed inputs: 2x2 target tokens, then `references` images' as
    many, 6 text tokens."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        return transformer(
            hidden_states=torch.randn(1, 4 * (1 + references), 16, generator=generator), timestep=torch.tensor([0.5]),
            encoder_hidden_states=torch.randn(1, 6, 32, generator=generator),
            img_shapes=[[(1, 2, 2)] * (1 + references)], return_dict=False,
        )[0]


def assert_lora_loads_whole(pipeline, run: Path, references: int = 0) -> None:
    """load_lora_weights(run) puts every tensor of the run's LoRA file into the pipeline's transformer
    (the same keys both ways, the same values), and the transformer's output changes."""
    from peft.utils import get_peft_model_state_dict
    from safetensors.torch import load_file

    # kubetune writes diffusers' LoRA names (lora.down / lora.up), which the loader reads as peft's lora_A / lora_B.
    saved = {key.replace(".lora.down.", ".lora_A.").replace(".lora.up.", ".lora_B."): value
             for key, value in load_file(run / "pytorch_lora_weights.safetensors").items()}
    assert saved and all(key.startswith("transformer.") for key in saved)
    before = transformer_output(pipeline.transformer, references)
    pipeline.load_lora_weights(run)
    [adapter] = pipeline.get_active_adapters()
    loaded = get_peft_model_state_dict(pipeline.transformer, adapter_name=adapter)
    assert {f"transformer.{key}" for key in loaded} == set(saved), "no missing and no unexpected keys"
    assert all(torch.equal(value, saved[f"transformer.{key}"].to(value.dtype)) for key, value in loaded.items())
    assert (transformer_output(pipeline.transformer, references) - before).abs().max() > 1e-4
