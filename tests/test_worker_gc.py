"""The worker's start-up heap is frozen once its engine is built (worker/process/main.py), so a
full collection while serving no longer scans it."""

from __future__ import annotations

import gc

from kvfleet.worker.process import main as worker_main


def test_the_startup_heap_leaves_the_collectors_scans():
    scanned_before = len(gc.get_objects())  # every object a full collection would scan now
    try:
        worker_main.freeze_startup_heap()
        assert gc.get_freeze_count() >= scanned_before // 2
        assert len(gc.get_objects()) < scanned_before // 10
        assert gc.isenabled()
        leftovers = [[] for _ in range(1000)]  # objects made after the freeze are scanned
        assert len(gc.get_objects()) >= 1000
        del leftovers
    finally:
        gc.unfreeze()


def test_the_worker_freezes_after_building_its_engine(monkeypatch):
    calls = []

    class Stop(Exception):
        pass

    monkeypatch.setattr(worker_main.signal, "signal", lambda *args: None)  # pytest's stay
    monkeypatch.setattr(worker_main, "freeze_startup_heap", lambda: calls.append("freeze"))

    def serve(*args, **kwargs):
        calls.append("serve")
        raise Stop

    monkeypatch.setattr(worker_main, "_serve", serve)

    class Settings:
        redis_url = "redis://127.0.0.1:1/0"
        otlp_traces_endpoint = None

        @staticmethod
        def resolved_worker_id():
            return "w-test"

    class Engine:
        def close(self):
            calls.append("close")

    monkeypatch.setattr(worker_main, "build_engine",
                        lambda settings: calls.append("engine") or Engine())
    try:
        worker_main.run_worker(Settings(), stop=None)
    except Stop:
        pass
    assert calls == ["engine", "freeze", "serve", "close"]
