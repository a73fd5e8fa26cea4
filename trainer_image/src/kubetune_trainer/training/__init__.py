"""The training step's parts every family shares: the loss math (diffusion, flow matching), optimizers and
schedules, DDP/FSDP, EMA, compilation, attention kernels, quantized bases, per-sample randomness, where the
weights live on the GPU and the copies to it."""
