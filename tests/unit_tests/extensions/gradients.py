"""The output of a function and the gradients of its inputs, for comparing a back end with the path it replaces."""

import torch


def output_and_grads(function, inputs: list) -> list:
    """[output, d loss / d input for each input], the loss being <output, a fixed non-uniform tensor>."""
    output = function(*inputs)
    upstream = torch.cos(torch.arange(output.numel(), device=output.device, dtype=torch.float32))
    output.backward(upstream.view_as(output).to(output.dtype))
    grads = [tensor.grad for tensor in inputs]
    for tensor in inputs:
        tensor.grad = None
    return [output.detach(), *grads]
