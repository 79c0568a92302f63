"""Neural-network layers in numpy/cupy with explicit backward.

Nothing here communicates: a model is plain array code that the parallel
layer (``axonhpc.parallel``) wraps. Arrays may be numpy or cupy; every layer
dispatches on its input's array module.

    from axonhpc import nn
    model = nn.Sequential(nn.Linear(64, 128, seed=0), nn.ReLU(), nn.Linear(128, 10, seed=1))
    loss_fn = nn.CrossEntropyLoss()
    loss = loss_fn(model(x), y)
    model.backward(loss_fn.backward())
"""
from . import functional
from .activation import GELU, ReLU, Tanh
from .attention import MultiHeadAttention
from .autocast import autocast
from .checkpointing import Checkpoint, cached_nbytes, checkpoint
from .container import Sequential
from .dropout import Dropout, key_dropout_by_sample
from .embedding import Embedding
from .linear import Linear
from .loss import CrossEntropyLoss, MSELoss
from .matmul import apply_matmul_precision
from .module import IncompatibleKeys, Module, call_backward, require_module
from .normalization import LayerNorm
from .parameter import Parameter, RemovableHandle
from .transformer import GPT, TransformerBlock

__all__ = [
    "Parameter",
    "RemovableHandle",
    "Module",
    "call_backward",
    "require_module",
    "IncompatibleKeys",
    "Sequential",
    "Linear",
    "ReLU",
    "GELU",
    "Tanh",
    "Dropout",
    "key_dropout_by_sample",
    "LayerNorm",
    "Embedding",
    "MultiHeadAttention",
    "TransformerBlock",
    "GPT",
    "Checkpoint",
    "checkpoint",
    "cached_nbytes",
    "CrossEntropyLoss",
    "MSELoss",
    "functional",
    "apply_matmul_precision",
    "autocast",
]
