"""An fp8 base under DDP: two CPU processes over gloo, as a multi-GPU job would run it."""
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from kubetune_api.ports import free_listen_port


def _train_one_step(rank: int, port: int, results) -> None:
    from kubetune_api.spec_model import AdapterSpec
    from kubetune_trainer.training import fp8
    from kubetune_trainer.families.lora import DIFFUSERS_ATTENTION_TARGETS, attach_lora
    from kubetune_trainer.models.tiny_models import tiny_sd_unet

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        unet = tiny_sd_unet(seed=0)  # both ranks load the same frozen weights, as from one checkpoint
        fp8.quantize_frozen_linears(unet)
        attach_lora(unet, AdapterSpec(rank=4), DIFFUSERS_ATTENTION_TARGETS)
        model = torch.nn.parallel.DistributedDataParallel(unet)  # broadcasting a Float8Tensor would fail
        generator = torch.Generator().manual_seed(rank)  # each rank its own batch
        sample = torch.randn(1, 4, 16, 16, generator=generator)
        text = torch.randn(1, 8, 32, generator=generator)
        model(sample, torch.tensor([100]), text).sample.pow(2).mean().backward()
        grad = next(p.grad for name, p in unet.named_parameters() if "lora_B" in name)  # A gets none while B is 0
        results[rank] = grad.clone()
    finally:
        dist.destroy_process_group()


def test_ddp_wraps_an_fp8_lora_model_and_averages_the_lora_gradients():
    with mp.Manager() as manager:
        results = manager.dict()
        mp.spawn(_train_one_step, args=(free_listen_port(), results), nprocs=2)
        grads = dict(results)
    assert set(grads) == {0, 1}
    assert torch.equal(grads[0], grads[1]), "DDP all-reduced the LoRA gradients"
    assert grads[0].abs().sum() > 0
