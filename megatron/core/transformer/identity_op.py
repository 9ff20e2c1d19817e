"""Placeholders for empty slots of a layer spec."""

import torch


class IdentityOp(torch.nn.Module):
    """Returns its first input unchanged (an absent norm or sub-layer); accepts and ignores the rest."""

    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x, *args, **kwargs):
        return x


class IdentityFuncOp(IdentityOp):
    """For slots that are called twice, `op(...)(x)`: the first call returns the identity function."""

    def forward(self, *args, **kwargs):
        return super().forward
