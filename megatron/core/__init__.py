"""Megatron-Core: the library layer. Never imports `megatron.training`."""
