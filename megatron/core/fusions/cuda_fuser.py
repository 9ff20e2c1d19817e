"""`cuda_fuser`: compile a small elementwise region with `torch.compile` when its inputs are on CUDA.

Megatron-LM's `jit_fuser` is `torch.compile` for the same purpose (bias-GeLU, bias-SwiGLU,
bias-dropout-add). Here the compiled version is used only for CUDA tensors: on CPU the eager function runs,
computing the same thing without a C++ toolchain or compile time in tests.
"""

import functools

import torch


def cuda_fuser(function):
    """Decorator: `function(*tensors...)` runs compiled (Inductor -> Triton) when its first argument is a
    CUDA tensor, eagerly otherwise. The compiled version is built on the first CUDA call. Inside a region
    that is being compiled as a whole (a compiled transformer layer) the plain function is traced into it."""
    compiled = None

    @functools.wraps(function)
    def dispatch(first, *args, **kwargs):
        nonlocal compiled
        if first.device.type != "cuda" or torch.compiler.is_compiling():
            return function(first, *args, **kwargs)
        if compiled is None:
            compiled = torch.compile(function)
        return compiled(first, *args, **kwargs)

    dispatch.eager = function
    return dispatch
