"""Batches made ahead on a thread: the same items in the same order, errors where they happened, and
an iterator closed early stops its thread."""

from __future__ import annotations

import threading
import time

import pytest

from captioner.data.batches import prefetched


def test_the_items_come_in_their_order():
    assert list(prefetched(iter(range(50)), depth=3)) == list(range(50))


def test_an_error_is_raised_where_its_item_would_have_come():
    def items():
        yield 1
        yield 2
        raise ValueError("row 7 is damaged")

    got = []
    with pytest.raises(ValueError, match="row 7"):
        for x in prefetched(items()):
            got.append(x)
    assert got == [1, 2]


def test_closing_early_stops_the_thread():
    made = []

    def items():
        for i in range(1000):
            made.append(i)
            yield i

    it = prefetched(items(), depth=2)
    assert next(it) == 0
    it.close()
    time.sleep(0.3)
    assert len(made) <= 4
    assert not any(t.name == "captioner-batches" and t.is_alive() for t in threading.enumerate())
