"""What the DDP oracles share (not an oracle itself): plain SGD by hand on a
DDP model, recording each step's gradients."""
import torch


def sgd_steps(model, net, inputs, lr=0.1):
    """Trains the DDP `model` (wrapping `net`) one step per (x, y) of
    `inputs` on the mean squared error, `p -= lr * p.grad` by hand; returns
    each step's gradients (after the all-reduce) by parameter name."""
    grads = []
    for x, y in inputs:
        model.zero_grad(set_to_none=True)
        ((model(x) - y) ** 2).mean().backward()
        grads.append({n: p.grad.flatten().tolist() for n, p in net.named_parameters()})
        with torch.no_grad():
            for p in net.parameters():
                p -= lr * p.grad
    return grads
