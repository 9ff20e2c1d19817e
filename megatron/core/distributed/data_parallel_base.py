"""`_BaseDataParallel` (Megatron-Core's name): what every data-parallel wrapper of a model chunk shares.

The wrapper holds the chunk as `module`, runs it as its forward, and hands out the chunk's state dicts
unchanged (no `module.` prefix), so that a checkpoint of a wrapped chunk matches the bare model's whatever the
wrapper: DDP's contiguous gradient buffers (distributed_data_parallel.py) or FSDP's sharded parameters
(torch_fully_sharded_data_parallel.py).
"""

import torch


class _BaseDataParallel(torch.nn.Module):
    def __init__(self, config, module: torch.nn.Module):
        super().__init__()
        self.config = config
        self.module = module

    def forward(self, *inputs, **kwargs):
        return self.module(*inputs, **kwargs)

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        """The wrapped module's state dict (no `module.` prefix), so checkpoints match the bare model."""
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def load_state_dict(self, state_dict, strict: bool = True):
        return self.module.load_state_dict(state_dict, strict=strict)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, *args, **kwargs):
        return self.module.sharded_state_dict(*args, **kwargs)
