"""Model-level enums of Megatron-Core."""

import enum


class ModelType(enum.Enum):
    """How a model's stages are arranged for pipeline parallelism.

    `encoder_or_decoder`: one stack (GPT, BERT). `encoder_and_decoder`: an encoder then a decoder (T5).
    """

    encoder_or_decoder = 1
    encoder_and_decoder = 2
