"""A hand-written SGD step in a module of its own, imported by grad_accum.py (GA_UPDATE=imported):
what ``parity exec --step-on hand_update:sgd_update`` names. Imports nothing from parity."""

import torch


def sgd_update(model, lr):
    with torch.no_grad():
        for p in model.parameters():
            if p.grad is not None:
                p.add_(p.grad, alpha=-lr)
                p.grad = None
