"""tune_gc_for_serving: the start-up heap is frozen and full collections are made rare."""

from __future__ import annotations

import gc

from kvfleet.gateway.app import GC_THRESHOLDS, tune_gc_for_serving


def test_tune_gc_freezes_the_heap_and_sets_the_thresholds():
    thresholds = gc.get_threshold()
    try:
        tune_gc_for_serving()
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == GC_THRESHOLDS
        assert gc.isenabled()
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
