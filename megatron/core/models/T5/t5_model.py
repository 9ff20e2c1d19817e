"""`T5Model`: a shared embedding, an encoder, a decoder that cross-attends to it, and a tied LM head.

    encoder_input_ids [b, se] -> embedding [se, b, h] -> encoder -> context [se, b, h]
    decoder_input_ids [b, sd] -> embedding [sd, b, h] -> decoder (causal self-attention, cross-attention
        to the context) [sd, b, h] -> lm_head.output_layer [sd, b, V/p]
        -> logits [b, sd, V/p], or per-token losses [b, sd] when `lm_labels` are given

Megatron's T5 is not Hugging Face's: learned absolute positions (shared by encoder and decoder, each
counting from 0), LayerNorm with bias, biases on every linear layer, GELU MLP, and the output layer
tied to the word embedding with a bias of its own.

Masks are boolean, True = masked, broadcastable to [b, 1, sq, sk]: e.g. the encoder's key padding
[b, 1, 1, se] for the encoder and for the cross-attention, and None for the decoder, whose causal mask
is built in (decoder padding comes after every real token, so causality already hides it from them).
"""

import torch

from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.mup import output_layer_init_method


class T5LMHead(MegatronModule):
    """[s, b, h] -> logits [s, b, V/p] (`output_layer`; tied to the word embedding and then with a bias)."""

    def __init__(
        self,
        config: TransformerConfig,
        parallel_output: bool,
        vocab_size: int,
        pre_process: bool = True,
        share_embeddings_and_output_weights: bool = False,
    ):
        super().__init__(config)
        self.parallel_output = parallel_output
        self.output_layer = ColumnParallelLinear(
            config.hidden_size,
            vocab_size,
            config=config,
            init_method=output_layer_init_method(config, share_embeddings_and_output_weights),
            bias=share_embeddings_and_output_weights,
            skip_bias_add=not share_embeddings_and_output_weights,
            gather_output=not parallel_output,
            skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
        )

    def forward(self, hidden_states: torch.Tensor, word_embeddings_weight: torch.Tensor | None) -> torch.Tensor:
        logits, _ = self.output_layer(hidden_states, weight=word_embeddings_weight)
        return logits


def t5_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
    """0, 1, ..., s-1 for every sequence: [b, s]."""
    positions = torch.arange(token_ids.size(1), dtype=torch.long, device=token_ids.device)
    return positions.unsqueeze(0).expand_as(token_ids)


class T5Model(LanguageModule):
    """T5 of Megatron-Core (same signature and state-dict keys).

    `config` shapes the decoder (and the embedding and LM head), `encoder_config` the encoder; the layer
    specs are block specs (`get_t5_encoder_with_local_block_spec(n)`, ...) or single layer specs. Keys:
    `embedding.*`, `encoder.layers.N.*`, `encoder.final_layernorm.*`, `decoder.layers.N.*` (with
    `pre_cross_attn_layernorm` and `cross_attention.linear_{q,kv,proj}`), `decoder.final_layernorm.*`,
    `lm_head.output_layer.*`. As in Megatron-Core, the output layer and the position embedding are also
    registered as `output_layer` and `position_embeddings`, so their keys appear under both names.

    Only learned absolute positions exist so far: `position_embedding_type` "rope" and "relative" (T5's
    relative position buckets, which Megatron-Core computes with Transformer Engine only) are refused, and
    `rotary_percent` / `relative_attention_*` are accepted for Megatron-Core's signature and unused.
    `fp16_lm_cross_entropy` is accepted too: the loss is always computed in fp32.
    """

    def __init__(
        self,
        config: TransformerConfig,
        encoder_config: TransformerConfig,
        transformer_encoder_layer_spec,
        transformer_decoder_layer_spec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        seq_len_interpolation_factor: float | None = None,
        relative_attention_num_buckets: int = 32,
        relative_attention_max_distance: int = 128,
        add_encoder: bool = True,
        add_decoder: bool = True,
    ):
        super().__init__(config)
        if position_embedding_type != "learned_absolute":
            raise ValueError(
                f"T5Model: position_embedding_type {position_embedding_type!r} is not supported yet; "
                "use learned_absolute"
            )
        reject_unsupported("T5Model", seq_len_interpolation_factor=seq_len_interpolation_factor)
        if not (add_encoder or add_decoder):
            raise ValueError("T5Model needs add_encoder or add_decoder (or both)")
        self.encoder_config = encoder_config
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process = pre_process, post_process
        self.add_encoder, self.add_decoder = add_encoder, add_decoder
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.encoder_hidden_state = None  # the encoder output received by decoder-only pipeline stages

        self.position_embeddings = None
        if pre_process:
            self.embedding = LanguageModelEmbedding(config, vocab_size, max_sequence_length, position_embedding_type)
            self.position_embeddings = self.embedding.position_embeddings
        stage = dict(pre_process=pre_process, post_process=post_process)
        self.encoder = TransformerBlock(encoder_config, transformer_encoder_layer_spec, **stage) if add_encoder else None
        self.decoder = TransformerBlock(config, transformer_decoder_layer_spec, **stage) if add_decoder else None
        if post_process:
            self.lm_head = T5LMHead(
                config, parallel_output, vocab_size, pre_process, share_embeddings_and_output_weights
            )
            self.output_layer = self.lm_head.output_layer
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def forward(
        self,
        encoder_input_ids: torch.Tensor,
        decoder_input_ids: torch.Tensor,
        encoder_attn_mask: torch.Tensor | None,
        decoder_attn_mask: torch.Tensor | None,
        encoder_decoder_attn_mask: torch.Tensor | None,
        lm_labels: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        output_encoder_hidden_only: bool = False,
        inference_context=None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        """Ids [b, se] / [b, sd], masks as in the module docstring, lm_labels [b, sd].

        Returns losses [b, sd] with `lm_labels`, else logits [b, sd, V/p]; the encoder output [se, b, h]
        with `output_encoder_hidden_only` (or on an encoder-only stage); the decoder hidden states on a
        stage without `post_process`. `encoder_hidden_states` skips the encoder.
        """
        reject_unsupported(
            "T5Model.forward",
            inference_context=inference_context is not None,
            packed_seq_params=packed_seq_params is not None,
        )
        if encoder_hidden_states is None:
            encoder_input = None
            if self.pre_process:
                encoder_input = self.embedding(encoder_input_ids, t5_position_ids(encoder_input_ids))
            if self.add_encoder:
                encoder_hidden_states = self.encoder(hidden_states=encoder_input, attention_mask=encoder_attn_mask)
            else:
                encoder_hidden_states = self.encoder_hidden_state
        if not self.add_decoder or output_encoder_hidden_only:
            return encoder_hidden_states

        decoder_input = None
        if self.pre_process:
            decoder_input = self.embedding(decoder_input_ids, t5_position_ids(decoder_input_ids))
        decoder_hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=decoder_attn_mask,
            context=encoder_hidden_states,
            context_mask=encoder_decoder_attn_mask,
        )
        if not self.post_process:
            return decoder_hidden_states
        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits = self.lm_head(decoder_hidden_states, word_embeddings_weight=output_weight)  # [sd, b, V/p]
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous()
        return self.compute_language_model_loss(lm_labels, logits)

    def set_input_tensor(self, input_tensor) -> None:
        """The activations from the previous pipeline stage: one tensor for a stage with the encoder;
        for a decoder-only stage (decoder hidden states, encoder output) or just the encoder output."""
        if not isinstance(input_tensor, (list, tuple)):
            input_tensor = [input_tensor]
        if self.add_encoder:
            if len(input_tensor) != 1:
                raise ValueError(f"T5Model.set_input_tensor: a stage with the encoder takes one tensor, got "
                                 f"{len(input_tensor)}")
            self.encoder.set_input_tensor(input_tensor[0])
        elif len(input_tensor) == 2:
            self.decoder.set_input_tensor(input_tensor[0])
            self.encoder_hidden_state = input_tensor[1]
        elif len(input_tensor) == 1:
            self.decoder.set_input_tensor(None)
            self.encoder_hidden_state = input_tensor[0]
        else:
            raise ValueError(f"T5Model.set_input_tensor: a decoder stage takes 1 or 2 tensors, got {len(input_tensor)}")

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word-embedding weight on the first stage, the LM head's output weight on the last."""
        if self.pre_process:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.lm_head.output_layer.weight
        return None
