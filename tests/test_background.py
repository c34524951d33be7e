"""The session's background jobs (``support/background.py``): jobs run in the order added, a
``late`` one only after ``start_late()`` and after every other job, a job its test asks for
before it started runs in the asking thread, and ``close()`` ends a thread still waiting for the
late jobs without running them. Starts no process."""

from __future__ import annotations

import threading
from pathlib import Path

from support.background import Background

WAIT_S = 30.0  # a deadline for each wait, never reached when the jobs behave


def _recorder(order: list[str], name: str, gate: threading.Event | None = None,
              started: threading.Event | None = None):
    def job(workdir: Path) -> str:
        assert workdir.is_dir()
        order.append(f"{name}@{threading.current_thread().name}")
        if started is not None:
            started.set()
        if gate is not None:
            assert gate.wait(WAIT_S)
        return name

    return job


def test_a_late_job_runs_after_the_others_and_only_once_let():
    bg, order = Background(), []
    bg.add("late", _recorder(order, "late"), late=True)  # added first, still runs last
    bg.add("a", _recorder(order, "a"))
    bg.add("b", _recorder(order, "b"))
    bg.start()
    try:
        assert bg._jobs["b"].done.wait(WAIT_S)
        assert not bg._jobs["late"].done.wait(0.3) and not bg._jobs["late"].claimed  # held back
        bg.start_late()
        assert bg._jobs["late"].done.wait(WAIT_S)  # (``result`` now would run it here if unstarted)
        assert bg.result("late") == "late"
        assert order == ["a@background-jobs", "b@background-jobs", "late@background-jobs"]
    finally:
        bg.close()


def test_a_late_job_asked_for_before_it_may_start_runs_in_the_asking_thread():
    bg, order = Background(), []
    gate, started = threading.Event(), threading.Event()
    bg.add("a", _recorder(order, "a", gate, started))
    bg.add("late", _recorder(order, "late"), late=True)
    bg.start()
    try:
        assert started.wait(WAIT_S)
        assert bg.result("late") == "late"  # while "a" still holds the background thread
        gate.set()
        assert bg.result("a") == "a"
        assert order == ["a@background-jobs", f"late@{threading.current_thread().name}"]
    finally:
        bg.close()


def test_close_ends_a_thread_waiting_for_late_jobs_without_running_them():
    bg, order = Background(), []
    bg.add("a", _recorder(order, "a"))
    bg.add("late", _recorder(order, "late"), late=True)
    bg.start()
    assert bg._jobs["a"].done.wait(WAIT_S)
    bg.close()
    bg._thread.join(WAIT_S)
    assert not bg._thread.is_alive()
    assert order == ["a@background-jobs"] and not bg._jobs["late"].claimed
