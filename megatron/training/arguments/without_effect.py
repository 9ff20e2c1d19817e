"""Flags of Megatron-LM that have no effect on a run here, each with the reason: flags that only change
Megatron-LM's speed where this implementation has no counterpart (or always does what they ask for), flags
Megatron-LM itself ignores, and --transformer-impl transformer_engine, whose model runs on this framework's own
layers. They are accepted, so that Megatron-LM's command lines run as written, and
each one given prints one line saying what happens instead: none is ignored silently.

A row is printed when its flag differs from the parser default (or, for a row that lists `values`, when it is
one of them). A flag whose behaviour lands here gets its own code and loses its row.
"""

import argparse
from dataclasses import dataclass

from megatron.core.extensions.transformer_engine import transformer_impl_note
from megatron.training.arguments.parser import given_rows
from megatron.training.arguments.reporting import print_rank_0


@dataclass(frozen=True)
class WithoutEffect:
    flag: str
    reason: str  # why nothing changes, and what happens here
    values: tuple = ()  # empty: any value other than the default


_SPEED_ONLY = "only changes Megatron-LM's speed"

WITHOUT_EFFECT = (
    WithoutEffect("--mup-width-mult", "--use-mup computes the width multiplier as --hidden-size / "
                                      "--mup-base-hidden-size (Megatron-LM overwrites this flag too), and nothing "
                                      "reads it without --use-mup"),
    WithoutEffect("--delay-offload-until-cuda-graph", "it defers offload copies until a per-layer CUDA graph has "
                                                      "replayed, and per-layer CUDA graphs are not built here: each "
                                                      "module's copies start during its forward pass"),
    WithoutEffect("--cross-entropy-loss-fusion", f"{_SPEED_ONLY}; the language-model loss here always runs the "
                                                 "fused vocab-parallel cross entropy (the same values)"),
    WithoutEffect("--no-align-grad-reduce", f"{_SPEED_ONLY}; each pipeline stage here always launches its "
                                            "gradient reduction from its own backward pass, as the flag asks"),
    WithoutEffect("--moe-permute-fusion", f"{_SPEED_ONLY}; the MoE token permutation here is one gather and one "
                                          "scatter-add, with no separate fused kernel"),
    WithoutEffect("--cross-entropy-fusion-impl", "it picks the kernel of --cross-entropy-loss-fusion (which refuses "
                                                 "te, as Megatron-LM does)", values=("te",)),
    WithoutEffect("--use-persistent-ckpt-worker", f"{_SPEED_ONLY}; a background save here is a thread started per "
                                                  "save, which costs no process start-up"),
    WithoutEffect("--async-strategy", f"{_SPEED_ONLY}; background saves here are this framework's own (a thread "
                                      "writing a copy of the tensors)"),
    WithoutEffect("--async-ckpt-use-cpu-shm", f"{_SPEED_ONLY}; a background save here copies the tensors to host "
                                              "memory in the training process anyway"),
    WithoutEffect("--ckpt-fully-parallel-load", f"{_SPEED_ONLY} (each data-parallel group reads a checkpoint once "
                                                "and exchanges it); every rank here reads its own pieces"),
    WithoutEffect("--ckpt-assume-constant-structure", f"{_SPEED_ONLY}; each save here plans its writes anew"),
    WithoutEffect("--num-distributed-optimizer-instances", f"{_SPEED_ONLY}; the optimizer state here is sharded "
                                                           "over the whole data-parallel group (one instance): the "
                                                           "same results, less memory per rank"),
    WithoutEffect("--overlap-param-gather-with-optimizer-step", f"{_SPEED_ONLY}; the parameter all-gathers here "
                                                                "overlap the next forward pass only"),
    WithoutEffect("--defer-embedding-wgrad-compute", f"{_SPEED_ONLY}; the output layer's weight gradients here are "
                                                     "computed in each microbatch's backward pass (the same gradients)"),
    WithoutEffect("--wgrad-deferral-limit", "it tunes --defer-embedding-wgrad-compute, which has no effect here"),
    WithoutEffect("--overlap-p2p-communication-warmup-flush", f"{_SPEED_ONLY}; pipeline transfers here are not "
                                                              "overlapped with compute"),
    WithoutEffect("--overlap-moe-expert-parallel-comm", f"{_SPEED_ONLY}; the expert-parallel all-to-alls here are "
                                                        "not overlapped with computation"),
    WithoutEffect("--moe-router-fusion", f"{_SPEED_ONLY}; the router here computes its top-k and auxiliary loss "
                                         "with plain torch operations (the same values)"),
    WithoutEffect("--delay-wgrad-compute", f"{_SPEED_ONLY}; the weight gradients here are computed in each "
                                           "backward pass, as the expert-parallel all-to-alls are not overlapped"),
    WithoutEffect("--tp-comm-overlap-cfg", "it configures Transformer Engine's userbuffers for --tp-comm-overlap; "
                                           "the overlap here is this framework's own and takes no configuration"),
    WithoutEffect("--outer-dp-sharding-strategy", "it shards the optimizer state over the outer data-parallel "
                                                  "dimension of Megatron-FSDP's hybrid sharding; here there is one "
                                                  "instance, sharded over the whole data-parallel group already",
                  values=("optim",)),
    WithoutEffect("--no-use-layer-wise-param-layout", "it picks the buffer layout of Megatron-LM's layer-wise "
                                                      "distributed optimizer (--optimizer muon "
                                                      "--use-distributed-optimizer; the same updates), which is not "
                                                      "built here: every data-parallel rank keeps the whole state"),
    WithoutEffect("--muon-use-syrk", f"{_SPEED_ONLY}; Muon's Gram matrices here are torch matmuls (the same "
                                     "products)"),
    WithoutEffect("--mla-down-proj-fusion", f"{_SPEED_ONLY}; the multi-latent attention down projections here "
                                            "are separate GEMMs computing the same function"),
    WithoutEffect("--moe-router-dtype", "the router here always computes its logits and scores in fp32, as the "
                                        "flag asks (fp64 is refused)", values=("fp32",)),
    WithoutEffect("--disable-gloo-process-groups", "it only saves Megatron-LM host resources; gloo groups are made "
                                                   "here (the distributed optimizer's checkpoint gathers and "
                                                   "background saves use them)"),
    WithoutEffect("--use-transformer-engine-op-fuser", f"{_SPEED_ONLY}; Transformer Engine is not used here"),
    WithoutEffect("--fp8-interval", "Transformer Engine ignores it since v1.8, and so does Megatron-LM"),
    # Megatron-LM's default: printed for every run that keeps it.
    WithoutEffect("--transformer-impl", transformer_impl_note(), values=("transformer_engine",)),
)


def print_without_effect_notes(args: argparse.Namespace) -> None:
    """One line per flag of WITHOUT_EFFECT that `args` sets (rank 0)."""
    for row, shown in given_rows(args, WITHOUT_EFFECT):
        print_rank_0(f"note: {shown} has no effect here: {row.reason}")
