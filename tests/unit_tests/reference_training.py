"""The single-process reference that the parallel training tests compare against: plain
`torch.optim.AdamW` (no weight decay on biases and 1-D params, as Megatron) with `clip_grad_norm_`."""

import torch


def adamw_reference_steps(model, batches, loss_of_batch, lr: float, weight_decay: float, clip: float) -> list[dict]:
    """Trains `model` one step per batch; returns [{weights}] then, per step, {loss, grads, grad_norm,
    weights} (grads before clipping). `loss_of_batch(model, batch)` is the scalar to backpropagate."""
    decayed = [param for param in model.parameters() if param.dim() > 1]
    others = [param for param in model.parameters() if param.dim() <= 1]
    optimizer = torch.optim.AdamW(
        [dict(params=decayed, weight_decay=weight_decay), dict(params=others, weight_decay=0.0)], lr=lr,
        betas=(0.9, 0.999), eps=1e-8,
    )
    steps = [dict(weights={key: value.clone() for key, value in model.state_dict().items()})]
    for batch in batches:
        optimizer.zero_grad()
        loss = loss_of_batch(model, batch)
        loss.backward()
        grads = {key: param.grad.clone() for key, param in model.named_parameters()}
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip).item()
        optimizer.step()
        steps.append(dict(loss=loss.item(), grads=grads, grad_norm=grad_norm,
                          weights={key: value.clone() for key, value in model.state_dict().items()}))
    return steps
