import gc
import weakref

from worker.heap import frozen_heap


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_a_frozen_heap_is_out_of_the_collectors_sight_and_back_in_after_the_block():
    node = Node()
    gone = weakref.ref(node)
    with frozen_heap() as frozen:
        assert frozen > 0 and gc.get_freeze_count() > 0
        del node  # garbage now, but frozen: a full collection does not see it
        gc.collect()
        assert gone() is not None
        made_inside = Node()
        inside = weakref.ref(made_inside)
        del made_inside
        gc.collect()  # what was made after the freeze is collected as usual
        assert inside() is None
    assert gc.get_freeze_count() == 0
    gc.collect()  # unfrozen: a dropped engine's cycles do not leak
    assert gone() is None
