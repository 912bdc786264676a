"""torch.distributed point-to-point transport (gloo on CPU, NCCL on GPUs), registered as "torchdist"."""
