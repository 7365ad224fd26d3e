"""`vit_export.memory.young_heap`: inside it, `release_memory` collects the cycles made inside and leaves what
lived before frozen (Python's `gc.freeze`); nested uses unfreeze once, when the outermost ends."""

from __future__ import annotations

import gc
import weakref

from vit_export.memory import release_memory, young_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the cycle collector frees it


def test_cycles_made_inside_are_collected_and_the_older_heap_stays_frozen():
    gc.disable()  # no automatic collection in between: only the explicit ones below
    try:
        _scenario()
    finally:
        gc.enable()


def _scenario() -> None:
    before = Node()
    old = weakref.ref(before)
    del before  # garbage, but made before the heap was frozen
    with young_heap():
        assert gc.get_freeze_count() > 0
        made = Node()
        young = weakref.ref(made)
        del made
        with young_heap():  # nested: still frozen when it ends
            pass
        assert gc.get_freeze_count() > 0
        release_memory()
        assert young() is None  # the export's own garbage is collected
        assert old() is not None  # the frozen heap is not walked
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old() is None  # unfrozen: collected as usual
