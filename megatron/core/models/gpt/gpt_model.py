"""`GPTModel`: embedding -> transformer decoder -> output layer, for one pipeline stage.

    input_ids [b, s] -> embedding [s, b, h] -> decoder [s, b, h] -> output layer [s, b, V/p]
    -> logits [b, s, V/p], or per-token losses [b, s] when `labels` are given.

With `parallel_output=True` (the default, as in Megatron) the logits stay split over the TP ranks
(each rank holds V/p vocabulary columns); the loss is computed without gathering them.
"""

import torch

from megatron.core.models.common.embeddings.language_model_embedding import (
    POSITION_EMBEDDING_TYPES,
    LanguageModelEmbedding,
)
from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.context_parallel import get_pos_emb_on_this_cp_rank
from megatron.core.transformer.mup import output_layer_init_method, scale_logits
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlock,
    get_mtp_layer_spec,
    process_mtp_loss,
)
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock, block_submodules
from megatron.core.transformer.transformer_config import TransformerConfig


class GPTModel(LanguageModule):
    """A GPT language model (Megatron-Core signature).

    `position_embedding_type`: "learned_absolute", "rope" or "none". `share_embeddings_and_output_weights`
    ties the output layer to the word embedding (then `output_layer.weight` is absent from the
    state dict on the first stage). `fp16_lm_cross_entropy` is accepted for compatibility: the loss is
    always computed in fp32.
    """

    def __init__(
        self,
        config: TransformerConfig,
        transformer_layer_spec: ModuleSpec,
        vocab_size: int,
        max_sequence_length: int,
        pre_process: bool = True,
        post_process: bool = True,
        fp16_lm_cross_entropy: bool = False,
        parallel_output: bool = True,
        share_embeddings_and_output_weights: bool = False,
        position_embedding_type: str = "learned_absolute",
        rotary_percent: float = 1.0,
        rotary_base: int = 10000,
        rope_scaling: bool = False,
        rope_scaling_factor: float = 8.0,
        seq_len_interpolation_factor: float | None = None,
        vp_stage: int | None = None,
        mtp_block_spec: ModuleSpec | None = None,
    ):
        super().__init__(config)
        if position_embedding_type not in POSITION_EMBEDDING_TYPES:
            raise ValueError(
                f"position_embedding_type {position_embedding_type!r} is not supported yet; "
                f"choose one of {', '.join(POSITION_EMBEDDING_TYPES)}"
            )
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type

        # Multi-token prediction on the last stage embeds the shifted tokens: under pipeline parallelism that
        # stage holds a copy of the word embedding, kept equal to the first stage's (setup_embeddings_and_
        # output_layer), as in Megatron-Core.
        mtp_here = post_process and bool(config.mtp_num_layers)
        if mtp_here and not pre_process and position_embedding_type == "learned_absolute":
            raise ValueError("multi-token prediction under pipeline parallelism with learned_absolute position "
                             "embeddings is not supported yet (use rope or none)")
        if pre_process or mtp_here:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type=position_embedding_type
            )
        # Multi-latent attention rotates its own d_rope channels (multi_latent_attention.py), as in Megatron-Core.
        self.uses_rotary_pos_emb = position_embedding_type == "rope" and not config.multi_latent_attention
        if self.uses_rotary_pos_emb:
            self.rotary_pos_emb = RotaryEmbedding(
                kv_channels=config.kv_channels,
                rotary_percent=rotary_percent,
                rotary_interleaved=config.rotary_interleaved,
                seq_len_interpolation_factor=seq_len_interpolation_factor,
                rotary_base=rotary_base,
                rope_scaling=rope_scaling,
                rope_scaling_factor=rope_scaling_factor,
                use_cpu_initialization=config.use_cpu_initialization,
            )
        self.decoder = TransformerBlock(
            config, transformer_layer_spec, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        self.mtp = None
        if post_process and config.mtp_num_layers:
            if mtp_block_spec is None:  # a depth with the decoder's last layer and final norm
                decoder_spec = block_submodules(config, transformer_layer_spec, vp_stage)
                mtp_block_spec = get_mtp_layer_spec(decoder_spec.layer_specs[-1], decoder_spec.layer_norm)
            self.mtp = MultiTokenPredictionBlock(config, mtp_block_spec, vp_stage)
        if post_process:
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=output_layer_init_method(config, share_embeddings_and_output_weights),
                bias=False,
                skip_bias_add=False,
                gather_output=not parallel_output,
                skip_weight_param_allocation=(pre_process or mtp_here) and share_embeddings_and_output_weights,
            )
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    def set_input_tensor(self, input_tensor) -> None:
        """Sets the activation from the previous pipeline stage (a tensor or a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"GPTModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.decoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None,
        attention_mask: torch.Tensor | None,
        decoder_input: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        inference_context=None,
        runtime_gather_output: bool | None = None,
        loss_mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """ids/positions [b, s]; attention_mask bool [b, 1, s, s] with True = masked, or None for plain
        causal attention. Returns logits [b, s, V/p] (or [b, s, V] when gathered), losses [b, s] when
        `labels` are given, or the hidden states [s, b, h] on a stage without `post_process`.

        With an `inference_context` (megatron.core.inference KV cache) the s tokens are the next ones
        after the `sequence_len_offset` cached positions: `position_ids` must hold their absolute
        positions, RoPE rotates by them, and with `materialize_only_last_token_logits` the logits are
        [b, 1, V/p], those of the last position only.

        With multi-token prediction (`config.mtp_num_layers`) and `labels`, the MTP depths run after the
        decoder and attach their losses (masked by `loss_mask` [b, s]) to the returned ones' graph
        (multi_token_prediction.py).
        """
        if inference_context is not None and self.config.sequence_parallel:
            raise ValueError("GPTModel: generation with an inference_context does not support sequence_parallel yet")
        if decoder_input is None and self.pre_process:
            decoder_input = self.embedding(input_ids=input_ids, position_ids=position_ids)
        rotary_pos_emb = None
        if self.uses_rotary_pos_emb:
            hidden = decoder_input if decoder_input is not None else self.decoder.input_tensor
            # With sequence parallelism each rank holds s/p positions; the rotation covers all s. With
            # context parallelism the angles of the whole sequence are computed and this CP rank's two
            # chunks kept, so that each token turns by its global position.
            sequence_parallel_ranks = self.config.tensor_model_parallel_size if self.config.sequence_parallel else 1
            context_parallel_ranks = self.config.context_parallel_size
            offset = 0 if inference_context is None else inference_context.sequence_len_offset
            rotary_pos_emb = self.rotary_pos_emb(
                hidden.size(0) * sequence_parallel_ranks * context_parallel_ranks, offset=offset
            )
            if context_parallel_ranks > 1:
                rotary_pos_emb = get_pos_emb_on_this_cp_rank(rotary_pos_emb, seq_dim=0)
            rotary_pos_emb = rotary_pos_emb.to(hidden.device)
        hidden_states = self.decoder(
            hidden_states=decoder_input,
            attention_mask=attention_mask,
            rotary_pos_emb=rotary_pos_emb,
            inference_context=inference_context,
        )
        if not self.post_process:
            return hidden_states
        if inference_context is not None and inference_context.materialize_only_last_token_logits:
            hidden_states = hidden_states[-1:]  # [1, b, h]: the next token depends on the last position only

        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        if self.mtp is not None and labels is not None and inference_context is None:
            hidden_states = self.mtp(input_ids, position_ids, hidden_states, attention_mask, self.embedding,
                                     rotary_pos_emb)
            hidden_states = process_mtp_loss(
                hidden_states, labels, loss_mask,
                lambda hidden: scale_logits(self.config, self.output_layer(hidden, weight=output_weight)[0]),
                self.compute_language_model_loss, self.config, self.training,
            )
        logits, _ = self.output_layer(hidden_states, weight=output_weight, runtime_gather_output=runtime_gather_output)
        logits = scale_logits(self.config, logits)
        if labels is None:
            return logits.transpose(0, 1).contiguous()  # [s, b, V/p] -> [b, s, V/p]
        return self.compute_language_model_loss(labels, logits, reuse_logits=True)  # nothing else reads them
