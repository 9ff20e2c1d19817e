"""Training-side data plumbing: the pretraining samplers and data loader."""
