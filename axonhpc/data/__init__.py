"""Data input for distributed training: per-rank sampling and mini-batches.

Nothing here communicates: ``DistributedSampler`` gives every rank a
disjoint share of the indices by deterministic arithmetic, and
``DataLoader`` batches numpy or cupy arrays (``np.memmap`` arrays too, read a
batch at a time); ``TextCorpus`` is byte-level text from the standard
library's source for language models, ``FileCorpus`` a corpus of your own on
disk (text, or nanoGPT's uint16 token files), memory-mapped.

    sampler = DistributedSampler(len(x), num_replicas=world.world_size, rank=world.rank, seed=0)
    loader = DataLoader((x, y), batch_size=32, sampler=sampler)
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        for xb, yb in loader: ...
"""
from .files import FileCorpus
from .loader import DataLoader
from .sampler import DistributedSampler
from .text import TextCorpus, TextWindows, sample_windows, stdlib_source_files

__all__ = ["DistributedSampler", "DataLoader", "FileCorpus", "TextCorpus", "TextWindows", "sample_windows",
           "stdlib_source_files"]
