"""`BertModel`: embedding (word + position + token type) -> bidirectional encoder -> LM head and binary head.

    input_ids, tokentype_ids [b, s] -> embedding [s, b, h] -> encoder [s, b, h]
        -> lm_head (dense, gelu, norm) -> output_layer (tied to the word embedding, + bias) -> [s, b, V/p]
        -> pooler (dense + tanh of position 0) -> binary_head [b, 2]     (sentence-order prediction)

`forward` returns (per-token MLM losses [b, s], binary logits [b, 2]) when given `lm_labels`, else
(logits [b, s, V/p], binary logits). The padding mask [b, s] (1 = token, 0 = padding) becomes the
attention mask [b, 1, 1, s] (True = masked key): every position attends to every real token, padding
queries included, so no softmax row is ever fully masked (that would give NaN with SDPA); the real
positions compute the same as with Megatron's [b, 1, s, s] mask.

Post-LN: the layers are pre-norm, but with `apply_residual_connection_post_layernorm` the residual is
taken after each norm, and the stack then computes the original post-norm BERT exactly:

    original BERT (post-norm)          here (pre-norm layers, residual = norm(x))
    e = LN_emb(embeddings)             layers.0.input_layernorm
    a = LN_att(e + attention(e))       layers.i.pre_mlp_layernorm
    o = LN_out(a + mlp(a))             layers.i+1.input_layernorm, or encoder.final_layernorm (last layer)

(the Hugging Face export in megatron/training/checkpointing/conversion/bert_hf.py maps the norms this way).
"""

import torch

from megatron.core.models.bert.bert_lm_head import BertLMHead
from megatron.core.models.bert.pooler import Pooler
from megatron.core.models.bert.replicated_linear import replicated_linear
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.model_parallel_config import reject_unsupported
from megatron.core.tensor_parallel.layers import ColumnParallelLinear
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlock
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.mup import output_layer_init_method


class BertModel(LanguageModule):
    """BERT of Megatron-Core (same signature and state-dict keys: `embedding.*`, `encoder.*`,
    `lm_head.dense.*`, `lm_head.layer_norm.*`, `output_layer.bias` (+ `.weight` when untied),
    `pooler.dense.*`, `binary_head.*`).

    `num_tokentypes`: rows of `embedding.tokentype_embeddings` (Megatron uses 2 with the binary head, else
    0). `add_binary_head` adds the pooler and the 2-way sentence-order head. `return_embeddings` makes
    `forward` return sentence embeddings [b, h] instead: the mean hidden state over each sequence's
    tokens between [CLS] and the final [SEP].

    Only learned absolute positions exist so far ("rope" is refused; `rotary_percent` is accepted for
    Megatron-Core's signature and unused); `fp16_lm_cross_entropy` is accepted too: the loss is always fp32.
    """

    def __init__(
        self,
        config: TransformerConfig,
        num_tokentypes: int,
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
        seq_len_interpolation_factor: float | None = None,
        add_binary_head: bool = True,
        return_embeddings: bool = False,
        vp_stage: int | None = None,
    ):
        super().__init__(config)
        if position_embedding_type != "learned_absolute":
            raise ValueError(
                f"BertModel: position_embedding_type {position_embedding_type!r} is not supported yet; "
                "use learned_absolute"
            )
        reject_unsupported("BertModel", seq_len_interpolation_factor=seq_len_interpolation_factor)
        if return_embeddings and not (post_process and add_binary_head):
            raise ValueError("BertModel: return_embeddings needs post_process=True and add_binary_head=True")
        self.transformer_layer_spec = transformer_layer_spec
        self.vocab_size, self.max_sequence_length = vocab_size, max_sequence_length
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.fp16_lm_cross_entropy = fp16_lm_cross_entropy
        self.parallel_output = parallel_output
        self.share_embeddings_and_output_weights = share_embeddings_and_output_weights
        self.position_embedding_type = position_embedding_type
        self.add_binary_head = add_binary_head
        self.return_embeddings = return_embeddings

        if pre_process:
            self.embedding = LanguageModelEmbedding(
                config, vocab_size, max_sequence_length, position_embedding_type, num_tokentypes=num_tokentypes
            )
        self.encoder = TransformerBlock(
            config, transformer_layer_spec, pre_process=pre_process, post_process=post_process, vp_stage=vp_stage
        )
        self.binary_head = None
        if post_process:
            self.lm_head = BertLMHead(config.hidden_size, config)
            self.output_layer = ColumnParallelLinear(
                config.hidden_size,
                vocab_size,
                config=config,
                init_method=output_layer_init_method(config, share_embeddings_and_output_weights),
                bias=True,
                skip_bias_add=False,
                gather_output=not parallel_output,
                skip_weight_param_allocation=pre_process and share_embeddings_and_output_weights,
            )
            if add_binary_head:
                self.binary_head = replicated_linear(config.hidden_size, 2, config.init_method, config)
                self.pooler = Pooler(config.hidden_size, config.init_method, config, config.sequence_parallel)
        if pre_process or post_process:
            self.setup_embeddings_and_output_layer()

    @staticmethod
    def bert_extended_attention_mask(attention_mask: torch.Tensor) -> torch.Tensor:
        """Padding mask [b, s] (1 = token) -> attention mask [b, 1, 1, s], True where the key is padding."""
        return (attention_mask < 0.5).unsqueeze(1).unsqueeze(1)

    @staticmethod
    def bert_position_ids(token_ids: torch.Tensor) -> torch.Tensor:
        """0, 1, ..., s-1 for every sequence: [b, s]."""
        positions = torch.arange(token_ids.size(1), dtype=torch.long, device=token_ids.device)
        return positions.unsqueeze(0).expand_as(token_ids)

    def set_input_tensor(self, input_tensor) -> None:
        """Sets the activation from the previous pipeline stage (a tensor or a one-element list)."""
        if isinstance(input_tensor, (list, tuple)):
            if len(input_tensor) != 1:
                raise ValueError(f"BertModel.set_input_tensor expects one tensor, got {len(input_tensor)}")
            input_tensor = input_tensor[0]
        self.encoder.set_input_tensor(input_tensor)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        tokentype_ids: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
        inference_context=None,
    ):
        """input_ids, attention_mask (padding mask, 1 = token), tokentype_ids, lm_labels: [b, s].

        Returns (losses [b, s] or logits [b, s, V/p], binary logits [b, 2] or None), the encoder output
        [s, b, h] on a stage without `post_process`, or sentence embeddings [b, h] with `return_embeddings`.
        """
        reject_unsupported("BertModel.forward", inference_context=inference_context is not None)
        extended_attention_mask = self.bert_extended_attention_mask(attention_mask)
        encoder_input = None
        if self.pre_process:
            position_ids = self.bert_position_ids(input_ids)
            encoder_input = self.embedding(input_ids, position_ids, tokentype_ids=tokentype_ids)
        hidden_states = self.encoder(hidden_states=encoder_input, attention_mask=extended_attention_mask)
        if not self.post_process:
            return hidden_states

        if self.return_embeddings:
            return self._sentence_embeddings(hidden_states, attention_mask)

        output_weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(self.lm_head(hidden_states), weight=output_weight)  # [s, b, V/p]
        binary_logits = self.binary_head(self.pooler(hidden_states, 0)) if self.add_binary_head else None
        if lm_labels is None:
            return logits.transpose(0, 1).contiguous(), binary_logits
        return self.compute_language_model_loss(lm_labels, logits), binary_logits

    def _sentence_embeddings(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Mean of hidden [s, b, h] over positions 1 .. n-2 of each sequence of n tokens ([CLS] and the
        last [SEP] left out), in fp32: [b, h]."""
        if self.config.sequence_parallel:
            raise ValueError("BertModel: return_embeddings does not support sequence_parallel yet")
        lengths = attention_mask.sum(dim=1)  # [b]
        positions = torch.arange(hidden_states.size(0), device=hidden_states.device).unsqueeze(1)  # [s, 1]
        inside = ((positions >= 1) & (positions < lengths - 1)).to(torch.float32)  # [s, b]
        summed = (hidden_states.float() * inside.unsqueeze(-1)).sum(dim=0)
        return summed / inside.sum(dim=0).unsqueeze(-1)
