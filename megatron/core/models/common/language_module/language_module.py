"""`LanguageModule`: what every language model shares - the token loss and the tied embedding /
output weight, including its copy on the last pipeline stage."""

import torch
import torch.distributed as dist

from megatron.core import parallel_state
from megatron.core.fusions.fused_cross_entropy import fused_vocab_parallel_cross_entropy
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.mup import mark_embedding_parameters


class LanguageModule(MegatronModule):
    """Base of GPT-style models. Subclasses set `pre_process`, `post_process`,
    `share_embeddings_and_output_weights`, `embedding` (first stage) and `output_layer` (last stage)."""

    def compute_language_model_loss(self, labels: torch.Tensor, logits: torch.Tensor, *,
                                    reuse_logits: bool = False) -> torch.Tensor:
        """Per-token loss [b, s] from labels [b, s] and TP-split logits [s, b, V/p] (computed in fp32 inside
        the fused kernels, without an fp32 copy of the logits). `reuse_logits`: the backward writes the logits'
        gradient over them (for logits made for this loss alone: the models' forward passes it)."""
        loss = fused_vocab_parallel_cross_entropy(logits, labels.transpose(0, 1).contiguous(),
                                                  reuse_logits=reuse_logits)
        return loss.transpose(0, 1).contiguous()

    def shared_embedding_or_output_weight(self) -> torch.Tensor | None:
        """The word-embedding weight where the stage has one (the first; the last with multi-token prediction),
        else the output weight on the last stage, else None."""
        if getattr(self, "embedding", None) is not None:
            return self.embedding.word_embeddings.weight
        if self.post_process:
            return self.output_layer.weight
        return None

    def setup_embeddings_and_output_layer(self) -> None:
        """Marks the embedding/output weights and, for tied weights split over pipeline stages, makes the
        last stage's copy equal to the first stage's.

        With PP > 1 the last stage has its own output weight: it is zeroed and all-reduced over the
        embedding group (first + last stage), which copies the first stage's values. After every backward
        the two grads are all-reduced over the same group (`shared_embedding` marks them for
        finalize_model_grads), so both copies stay identical. A last stage with multi-token prediction holds
        a word embedding instead (its output layer then uses it when tied), copied and kept equal alike,
        whether the output layer is tied or not.
        """
        if getattr(self, "embedding", None) is not None:
            self.embedding.word_embeddings.weight.is_embedding_or_output_parameter = True
        if self.post_process and self.output_layer.weight is not None:
            self.output_layer.weight.is_embedding_or_output_parameter = True
        if self.config.use_mup:  # muP's "embedding-class" params keep the base LR and epsilon
            if getattr(self, "embedding", None) is not None:
                mark_embedding_parameters(self.embedding)
            if self.post_process and self.output_layer.weight is not None:
                self.output_layer.weight.is_embedding_parameter = True
        last_stage_embedding = bool(getattr(self.config, "mtp_num_layers", None))
        if not (self.share_embeddings_and_output_weights or last_stage_embedding):
            return
        if parallel_state.get_pipeline_model_parallel_world_size() == 1:
            return
        if self.pre_process and not self.post_process:
            self.shared_embedding_or_output_weight().shared_embedding = True
        if self.post_process and not self.pre_process:
            copy = self.shared_embedding_or_output_weight()
            copy.data.fill_(0)
            copy.shared = True
            copy.shared_embedding = True
        if dist.is_initialized() and parallel_state.is_rank_in_embedding_group():
            weight = self.shared_embedding_or_output_weight()
            # The weights may still be on the CPU here (get_model moves the model to the GPU afterwards);
            # NCCL needs the collective's tensor on the GPU.
            values = weight.data.to(parallel_state.collective_device())
            dist.all_reduce(values, group=parallel_state.get_embedding_group())
            weight.data.copy_(values)
