"""Optimizers with PyTorch's update rules, updating parameters in place.

Nothing here communicates; a sharded optimizer (ZeRO) in ``axonhpc.parallel``
wraps these classes.

    from axonhpc import optim
    opt = optim.AdamW(model.parameters(), lr=1e-3)
    optim.clip_grad_norm(model.parameters(), 1.0)
    opt.step(); opt.zero_grad()
"""
from .adam import Adam, AdamW
from .clip import clip_grad_norm
from .optimizer import Optimizer
from .segments import Segments
from .sgd import SGD

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "Segments", "clip_grad_norm"]
