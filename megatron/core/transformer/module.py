"""`MegatronModule`, the base of every Megatron-Core model piece, and `Float16Module`, the wrapper that
runs a model in fp16/bf16 with fp32 at its edges."""

import torch

from megatron.core import parallel_state
from megatron.core.dist_checkpointing.model_sharding import model_sharded_state_dict
from megatron.core.transformer.transformer_config import TransformerConfig


class MegatronModule(torch.nn.Module):
    """A `torch.nn.Module` that keeps its `TransformerConfig`."""

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        """The state dict written to torch-format checkpoints (the plain state dict)."""
        return self.state_dict(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        """{state-dict name: ShardedTensor} for `--ckpt-format torch_dist` (megatron.core.dist_checkpointing):
        each tensor as a piece of its global tensor, with global layer numbers in the keys. Collective over
        the tensor-parallel group. `sharded_offsets` and `metadata` are Megatron-Core's; neither is used."""
        if sharded_offsets:
            raise ValueError("sharded_state_dict: extra sharded_offsets are not supported; call it on the model")
        return model_sharded_state_dict(self, prefix)


def _convert_floats(value, from_dtypes: tuple, convert):
    """Applies `convert` to every tensor of dtype in `from_dtypes` inside nested tuples/lists/dicts."""
    if isinstance(value, (tuple, list)):
        return type(value)(_convert_floats(item, from_dtypes, convert) for item in value)
    if isinstance(value, dict):
        return {key: _convert_floats(item, from_dtypes, convert) for key, item in value.items()}
    if isinstance(value, torch.Tensor) and value.dtype in from_dtypes:
        return convert(value)
    return value


def fp32_to_float16(value, float16_convertor):
    """Casts the fp32 tensors in `value` with `float16_convertor` (ids, masks and labels are untouched)."""
    return _convert_floats(value, (torch.float32,), float16_convertor)


def float16_to_fp32(value):
    """Casts the fp16/bf16 tensors in `value` to fp32."""
    return _convert_floats(value, (torch.float16, torch.bfloat16), lambda tensor: tensor.float())


class Float16Module(MegatronModule):
    """Holds `module` in fp16 (`config.fp16`) or bf16 (`config.bf16`).

    The first pipeline stage casts fp32 inputs to that dtype; the last stage returns fp32 outputs.
    `state_dict` and `load_state_dict` pass through, so checkpoint keys are the inner module's.
    """

    def __init__(self, config: TransformerConfig, module: torch.nn.Module):
        super().__init__(config)
        if config.fp16 == config.bf16:
            raise ValueError("Float16Module needs exactly one of config.fp16 / config.bf16 set to True")
        self.dtype = torch.float16 if config.fp16 else torch.bfloat16
        self.add_module("module", module.to(self.dtype))

    def float16_convertor(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype)

    def set_input_tensor(self, input_tensor) -> None:
        return self.module.set_input_tensor(input_tensor)

    def forward(self, *inputs, fp32_output: bool = True, **kwargs):
        vp_stage = getattr(self.module, "vp_stage", None)
        if parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage):
            inputs = fp32_to_float16(inputs, self.float16_convertor)
            kwargs = fp32_to_float16(kwargs, self.float16_convertor)
        outputs = self.module(*inputs, **kwargs)
        if parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage) and fp32_output:
            outputs = float16_to_fp32(outputs)
        return outputs

    def state_dict(self, destination=None, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict(destination=destination, prefix=prefix, keep_vars=keep_vars)

    def state_dict_for_save_checkpoint(self, prefix: str = "", keep_vars: bool = False):
        return self.module.state_dict_for_save_checkpoint(prefix=prefix, keep_vars=keep_vars)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None):
        return self.module.sharded_state_dict(prefix, sharded_offsets, metadata)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        return self.module.load_state_dict(state_dict, strict=strict, assign=assign)
