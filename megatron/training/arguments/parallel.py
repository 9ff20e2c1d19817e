"""Parallelism and distributed-runtime flags.

The dense ranks factor as world = TP x CP x DP x PP (rank order `tp-cp-ep-dp-pp`, TP fastest). DP is never
given: validation derives it as world / (TP x PP x CP).
"""

import argparse
import os


def _add_distributed_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    group = parser.add_argument_group(title="distributed")
    group.add_argument("--tensor-model-parallel-size", type=int, default=1, help="Tensor-parallel size (TP).")
    group.add_argument("--pipeline-model-parallel-size", type=int, default=1, help="Pipeline-parallel size (PP).")
    group.add_argument("--context-parallel-size", type=int, default=1,
                       help="Context-parallel size (CP); the sequence length must be divisible by 2 x CP.")
    group.add_argument("--cp-comm-type", nargs="+", default=["p2p"],
                       help="Context-parallel communication: p2p, a2a, allgather or a2a+p2p (one per layer "
                            "or one for all).")
    group.add_argument("--hierarchical-context-parallel-sizes", nargs="+", type=int, default=None,
                       help="Context-parallel sizes per level for a2a+p2p.")
    group.add_argument("--expert-model-parallel-size", type=int, default=1, help="Expert-parallel size (EP).")
    group.add_argument("--expert-tensor-parallel-size", type=int, default=None,
                       help="Tensor-parallel size inside experts (default: TP).")
    group.add_argument("--num-layers-per-virtual-pipeline-stage", type=int, default=None,
                       help="Layers per virtual pipeline stage (interleaved schedule).")
    group.add_argument("--num-virtual-stages-per-pipeline-rank", type=int, default=None,
                       help="Virtual pipeline stages per pipeline rank (interleaved schedule).")
    group.add_argument("--pipeline-model-parallel-layout", type=str, default=None,
                       help='Explicit layer layout of the pipeline stages, e.g. "E|(t|)*3,m|m||L".')
    group.add_argument("--decoder-first-pipeline-num-layers", type=int, default=None,
                       help="Layers on the first pipeline stage (uneven split).")
    group.add_argument("--decoder-last-pipeline-num-layers", type=int, default=None,
                       help="Layers on the last pipeline stage (uneven split).")
    group.add_argument("--account-for-embedding-in-pipeline-split", action="store_true",
                       help="Count the input embedding as one layer when splitting layers over stages.")
    group.add_argument("--account-for-loss-in-pipeline-split", action="store_true",
                       help="Count the loss as one layer when splitting layers over stages.")
    group.add_argument("--microbatch-group-size-per-virtual-pipeline-stage", type=int, default=None,
                       dest="microbatch_group_size_per_vp_stage",
                       help="Contiguous microbatches per virtual stage (default: PP).")
    group.add_argument("--no-overlap-p2p-communication", action="store_false", dest="overlap_p2p_comm",
                       help="Do not overlap pipeline send/receive with compute (off without virtual stages).")
    group.add_argument("--no-scatter-gather-tensors-in-pipeline", action="store_false",
                       dest="scatter_gather_tensors_in_pipeline",
                       help="Send whole activations between stages instead of TP-scattered chunks.")
    group.add_argument("--sequence-parallel", action="store_true",
                       help="Shard norms and dropout over the sequence within the TP group (off when TP = 1).")
    group.add_argument("--tp-comm-overlap", action="store_true",
                       help="Overlap tensor-parallel communication with GEMMs (needs --sequence-parallel).")
    group.add_argument("--use-distributed-optimizer", action="store_true",
                       help="Shard optimizer state over data-parallel ranks (ZeRO-1).")
    group.add_argument("--overlap-grad-reduce", action="store_true",
                       help="Overlap the data-parallel gradient reduction with the backward pass.")
    group.add_argument("--overlap-param-gather", action="store_true",
                       help="Overlap the parameter all-gather with the forward pass (distributed optimizer).")
    group.add_argument("--no-align-grad-reduce", action="store_false", dest="align_grad_reduce",
                       help="Let each pipeline stage launch its gradient reduction independently.")
    group.add_argument("--no-align-param-gather", action="store_false", dest="align_param_gather",
                       help="Let each pipeline stage launch its parameter all-gather independently.")
    group.add_argument("--ddp-bucket-size", type=int, default=None,
                       help="Parameters per gradient bucket (default max(4e7, 1e6 x DP) when overlapping).")
    group.add_argument("--ddp-average-in-collective", action="store_true",
                       help="Average gradients inside the collective instead of pre-scaling them.")
    group.add_argument("--use-torch-fsdp2", action="store_true",
                       help="Shard params, grads and optimizer state over data-parallel ranks with PyTorch FSDP2.")
    group.add_argument("--torch-fsdp2-no-reshard-after-forward", action="store_false",
                       dest="torch_fsdp2_reshard_after_forward",
                       help="With --use-torch-fsdp2: keep each layer's params gathered from forward to backward.")
    group.add_argument("--use-megatron-fsdp", action="store_true",
                       help="Shard over data-parallel ranks as --data-parallel-sharding-strategy says.")
    group.add_argument("--data-parallel-sharding-strategy", default="optim_grads_params",
                       choices=["no_shard", "optim", "optim_grads", "optim_grads_params"],
                       help="With --use-megatron-fsdp, what is sharded: nothing, optimizer state (ZeRO-1), + grads "
                            "(ZeRO-2), + params (ZeRO-3).")
    group.add_argument("--no-gradient-accumulation-fusion", action="store_false",
                       dest="gradient_accumulation_fusion",
                       help="Do not fuse weight-gradient accumulation into the fp32 main_grad buffer.")
    group.add_argument("--use-tp-pp-dp-mapping", action="store_true",
                       help="Order ranks tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp.")
    group.add_argument("--distributed-backend", default="nccl", choices=["nccl", "gloo"],
                       help="torch.distributed backend.")
    group.add_argument("--distributed-timeout-minutes", type=int, default=10,
                       help="Timeout of torch.distributed collectives.")
    # torch.distributed.launch passes --local_rank; torchrun sets LOCAL_RANK.
    group.add_argument("--local-rank", "--local_rank", type=int, default=int(os.getenv("LOCAL_RANK", "0")),
                       dest="local_rank", help="Local rank from the launcher (default: LOCAL_RANK).")
    return parser
