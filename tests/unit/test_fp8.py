"""fp8 frozen weights under a LoRA, on the CPU: the quantization is real (float8 + a scale per row), the
LoRA trains exactly as on the dequantized model, and backward keeps no high-precision copy of a weight.
(The GPU check that fp8 trains and saves memory on CUDA is benchmarks/gpu_quantization_check.py.)"""
import copy

import pytest
import torch

from kubetune_api.spec_model import AdapterSpec
from kubetune_trainer.training import fp8
from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS, attach_lora
from kubetune_trainer.models.tiny_models import tiny_sd_unet


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.to_q = torch.nn.Linear(32, 32)
        self.norm1 = torch.nn.Module()
        self.norm1.linear = torch.nn.Linear(32, 64)   # an adaptive norm's modulation
        self.ff = torch.nn.Linear(32, 32, bias=False)


class Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.time_embed = torch.nn.Linear(8, 32)
        self.conv = torch.nn.Conv2d(4, 4, 1)
        self.blocks = torch.nn.ModuleList([Block(), Block()])
        self.proj_out = torch.nn.Linear(32, 4)


def lora_unet(quantized: bool, dtype=torch.float32):
    unet = tiny_sd_unet(seed=0).to(dtype)
    if quantized:
        assert fp8.quantize_frozen_linears(unet) > 0
    attach_lora(unet, AdapterSpec(rank=4), DIFFUSERS_ATTENTION_TARGETS)
    torch.manual_seed(1)
    for name, param in unet.named_parameters():
        if "lora_B" in name:  # nonzero, so that gradients reach every LoRA weight
            torch.nn.init.normal_(param, std=0.02)
    return unet


def unet_inputs(dtype=torch.float32):
    generator = torch.Generator().manual_seed(0)
    return (torch.randn(2, 4, 16, 16, generator=generator).to(dtype), torch.tensor([10, 500]),
            torch.randn(2, 8, 32, generator=generator).to(dtype))


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same model with plain Linear layers holding the dequantized weights."""
    plain = copy.deepcopy(model)
    for module in plain.modules():
        if isinstance(module, fp8.Float8FrozenLinear):
            weight = module.weight.dequantize()
            module.__class__ = torch.nn.Linear
            module.weight = torch.nn.Parameter(weight, requires_grad=False)
    return plain


def test_linear_weights_become_float8_with_a_scale_per_row_and_sensitive_layers_stay_precise():
    model = Toy().to(torch.bfloat16)
    originals = {name: module.weight.detach().clone() for name, module in model.named_modules()
                 if isinstance(module, torch.nn.Linear)}
    assert fp8.quantize_frozen_linears(model) == 4
    quantized = {name for name, module in model.named_modules() if isinstance(module, fp8.Float8FrozenLinear)}
    assert quantized == {"blocks.0.to_q", "blocks.0.ff", "blocks.1.to_q", "blocks.1.ff"}, "embedder, norm, proj_out kept"
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        if name in quantized:
            weight = module.weight
            assert weight.qdata.dtype == torch.float8_e4m3fn and weight.scale.shape == (weight.shape[0], 1)
            assert weight.dtype == torch.bfloat16, "reports the loading dtype (peft sizes the LoRA by it)"
            error = (weight.dequantize().float() - originals[name].float()).abs()
            row_max = originals[name].float().abs().amax(dim=1, keepdim=True)
            assert (error <= row_max / 16 + 1e-6).all(), "e4m3 keeps 3 mantissa bits: within 1/16 of the row's max"
        else:
            assert type(module.weight) is torch.nn.Parameter and torch.equal(module.weight, originals[name]), name
    assert isinstance(model.conv.weight, torch.nn.Parameter) and model.conv.weight.dtype == torch.bfloat16


def test_a_lora_on_the_fp8_unet_computes_what_it_would_on_the_dequantized_unet():
    unet = lora_unet(quantized=True)
    to_q = next(module for name, module in unet.named_modules() if name.endswith("attn1.to_q"))
    assert isinstance(to_q.base_layer, fp8.Float8FrozenLinear), "peft wrapped the float8 layer"
    assert {p.dtype for p in unet.parameters() if p.requires_grad} == {torch.float32}, "the LoRA trains in fp32"
    plain = dequantized_copy(unet)
    outputs = []
    for model in (unet, plain):
        out = model(*unet_inputs()).sample
        out.float().pow(2).mean().backward()
        outputs.append(out)
    assert torch.equal(outputs[0], outputs[1])
    grads = [{name: p.grad for name, p in model.named_parameters() if p.requires_grad} for model in (unet, plain)]
    assert grads[0].keys() == grads[1].keys() and len(grads[0]) > 0
    for name, grad in grads[0].items():
        assert grad is not None and grad.abs().sum() > 0, name
        assert torch.equal(grad, grads[1][name]), name


def test_backward_keeps_the_float8_weight_not_a_dequantized_copy():
    def saved_during(model, x):
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(tuple(t.shape)) or t, lambda t: t):
            model(x).sum()
        return saved

    x = torch.randn(4, 64, dtype=torch.bfloat16, requires_grad=True)
    ours = torch.nn.Linear(64, 128).to(torch.bfloat16)
    fp8.quantize_frozen_linears(ours)
    assert saved_during(ours, x) == [], "nothing new is kept: the weight is the layer's own float8 parameter"

    # Why _Float8Linear exists: torchao's own weight-only linear keeps a dequantized copy of the weight.
    from torchao.quantization import Float8WeightOnlyConfig, quantize_

    theirs = torch.nn.Linear(64, 128).to(torch.bfloat16)
    quantize_(theirs, Float8WeightOnlyConfig(set_inductor_config=False))
    assert any(shape in {(128, 64), (64, 128)} for shape in saved_during(theirs, x))


def test_the_lora_trains_and_the_float8_base_stays_as_it_was():
    unet = lora_unet(quantized=True)
    frozen = {name: p.qdata.clone() for name, p in unet.named_parameters() if fp8.is_float8(p)}
    lora = [p for p in unet.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(lora, lr=1e-2)
    sample, timesteps, text = unet_inputs()
    target = torch.zeros(2, 4, 16, 16)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.mse_loss(unet(sample, timesteps, text).sample, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.9, losses
    for name, param in unet.named_parameters():
        if name in frozen:
            assert torch.equal(param.qdata, frozen[name]) and not param.requires_grad, name


def test_a_float8_weight_that_asks_for_gradients_is_refused():
    layer = torch.nn.Linear(8, 8)
    fp8.quantize_frozen_linears(layer)
    layer.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="fp8 weights are frozen: train a LoRA"):
        layer(torch.randn(2, 8))


def test_ddp_is_told_the_float8_weights_by_their_names_after_peft_renamed_them():
    unet = lora_unet(quantized=True)
    names = list(unet._ddp_params_and_buffers_to_ignore)
    float8 = [name for name, p in unet.named_parameters() if fp8.is_float8(p)]
    assert names == float8 and any(".to_q.base_layer.weight" in name for name in names)
    trainable = {name for name, p in unet.named_parameters() if p.requires_grad}
    assert not trainable & set(names), "LoRA weights are still synchronised by DDP"
