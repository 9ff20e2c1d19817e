"""`RunConfig`: every section of a run's configuration, in the order their flag groups appear in --help."""

import argparse
import dataclasses
import functools
from dataclasses import dataclass

from megatron.training.config.checkpointing import CheckpointingConfig
from megatron.training.config.data import DataConfig
from megatron.training.config.fields import argparse_kwargs
from megatron.training.config.linear_attention import LinearAttentionConfig
from megatron.training.config.logging import LoggingConfig
from megatron.training.config.mla import MultiLatentAttentionConfig, MultiTokenPredictionConfig
from megatron.training.config.model import InitializationConfig, KernelFusionConfig, MupConfig, NetworkSizeConfig
from megatron.training.config.moe import MoEConfig
from megatron.training.config.optimizer import LearningRateConfig, OptimizerChoiceConfig, RegularizationConfig
from megatron.training.config.parallel import DistributedConfig
from megatron.training.config.precision import LowPrecisionConfig, MixedPrecisionConfig
from megatron.training.config.resilience import ResilienceConfig
from megatron.training.config.training import AutoresumeConfig, TrainingConfig, ValidationConfig


@dataclass(kw_only=True)
class RunConfig:
    """One instance of each section; `args.<flag dest>` is `run_config.<section>.<flag dest>`."""

    network_size: NetworkSizeConfig
    kernel_fusion: KernelFusionConfig
    regularization: RegularizationConfig
    training: TrainingConfig
    initialization: InitializationConfig
    mup: MupConfig
    optimizer: OptimizerChoiceConfig
    learning_rate: LearningRateConfig
    checkpointing: CheckpointingConfig
    mixed_precision: MixedPrecisionConfig
    low_precision: LowPrecisionConfig
    distributed: DistributedConfig
    validation: ValidationConfig
    data: DataConfig
    autoresume: AutoresumeConfig
    moe: MoEConfig
    multi_latent_attention: MultiLatentAttentionConfig
    multi_token_prediction: MultiTokenPredictionConfig
    linear_attention: LinearAttentionConfig
    logging: LoggingConfig
    resilience: ResilienceConfig

    @classmethod
    def section_classes(cls) -> tuple:
        """The section classes, in --help order."""
        return tuple(field.type for field in dataclasses.fields(cls))

    @classmethod
    @functools.cache
    def flag_names(cls) -> dict:
        """{dest: the flag that sets it}, e.g. {"fp8": "--fp8-format"}, for messages."""
        return {field.name: argparse_kwargs(section, field)[0][0]
                for section in cls.section_classes() for field in dataclasses.fields(section)}

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> "RunConfig":
        return cls(**{field.name: field.type.from_namespace(args) for field in dataclasses.fields(cls)})

    def sections(self) -> tuple:
        return tuple(getattr(self, field.name) for field in dataclasses.fields(self))

    def as_dict(self) -> dict:
        """{dest: value} of every flag of every section."""
        return {name: value for section in self.sections() for name, value in vars(section).items()}
