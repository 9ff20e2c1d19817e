"""State-space and linear-attention layers: Gated DeltaNet (gated_delta_net/)."""
