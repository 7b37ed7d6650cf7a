"""Keep the cyclic garbage collector off a serving process's startup heap.

A process that holds torch, the demo engine, Ray Serve and kvray's app tracks some 410,000
objects; a full collection walks them all and holds the GIL throughout, so every thread of the
process stops: the engine's step, the stream that carries its tokens. Almost none of those
objects (modules, weights, the tokenizer) ever become garbage, so serving processes move them
out of the collector's sight once they are built, as vLLM and SGLang do; the collector then
walks only what was made since.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


def freeze_heap() -> int:
    """Collect once, then exempt every surviving object from later collections (for the
    process's life); the number now exempt."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


@contextmanager
def frozen_heap() -> Iterator[int]:
    """`freeze_heap` for a block, for a process that builds and drops engines (a benchmark):
    what was exempt is collectable again after it, so a dropped engine's cycles do not leak."""
    try:
        yield freeze_heap()
    finally:
        gc.unfreeze()
