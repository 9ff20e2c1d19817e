"""Fully sharded data parallelism: the DTensor shards of FSDP2 and Megatron-FSDP's sharding strategies."""
