"""Self-contained subprocess runs started early, on a daemon thread, one at a time, and
asserted on by their tests later.

A module lists its jobs in ``BACKGROUND_JOBS = {test_name: job}``: ``job(workdir)`` starts what
the test used to start (a CLI run in a subprocess, say), waits for it and returns what the test
asserts on; an exception it raises is raised again by ``result`` in the test. ``conftest.py``
starts the jobs of the selected tests when collection ends, so they run while the tests that
start nothing occupy one core (this machine has two), and the tests themselves run where the
file order puts them. A job that has not started when its test asks runs right there.

A job added ``late`` waits, after the others, until ``start_late()`` (``conftest.py`` calls it
when the last live modules begin: they start their own processes one test at a time and leave
a core idle for much of it), so it runs there instead of beside the live modules that keep both
cores busy.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any, Callable

__all__ = ["BACKGROUND", "Background", "track"]


class _Job:
    def __init__(self, name: str, fn: Callable[[Path], Any]) -> None:
        self.name, self.fn = name, fn
        self.done = threading.Event()
        self.late = False
        self.claimed = False
        self.value: Any = None
        self.error: BaseException | None = None


class Background:
    def __init__(self) -> None:
        self._jobs: dict[str, _Job] = {}
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._dirs: list[Path] = []
        self._late = threading.Event()
        self._closed = False
        self.procs: list[subprocess.Popen] = []
        #: Where each job's start and end are written (``conftest.py``'s resource log).
        self.log: Callable[[str], None] = lambda msg: None

    def add(self, name: str, fn: Callable[[Path], Any], *, late: bool = False) -> None:
        self._jobs.setdefault(name, _Job(name, fn)).late = late

    def start(self) -> None:
        """Run every job added so far on one daemon thread, in order, the late ones once
        ``start_late`` is called."""
        if self._thread is None and self._jobs:
            self._thread = threading.Thread(target=self._run_all, name="background-jobs", daemon=True)
            self._thread.start()

    def start_late(self) -> None:
        """Let the late jobs run (after the others)."""
        if not self._late.is_set():
            self.log("background: late jobs may start")
            self._late.set()

    def _claim(self, job: _Job) -> bool:
        with self._lock:
            if job.claimed:
                return False
            job.claimed = True
            return True

    def _run(self, job: _Job) -> None:
        workdir = Path(tempfile.mkdtemp(prefix=f"mr_bg_{job.name}_"))
        self._dirs.append(workdir)
        self.log(f"background job {job.name} started")
        try:
            job.value = job.fn(workdir)
        except BaseException as exc:  # noqa: BLE001 - raised again in the test
            job.error = exc
        finally:
            self.log(f"background job {job.name} ended" + (f" ({type(job.error).__name__})" if job.error else ""))
            job.done.set()

    def _run_all(self) -> None:
        jobs = list(self._jobs.values())
        for job in [j for j in jobs if not j.late] + [j for j in jobs if j.late]:
            if job.late:
                self._late.wait()  # set by start_late, or by close (then nothing more runs)
            if not self._closed and self._claim(job):
                self._run(job)

    def result(self, name: str, fn: Callable[[Path], Any] | None = None) -> Any:
        """The job's return value (waiting for it), or its exception raised here."""
        if name not in self._jobs:
            if fn is None:
                raise KeyError(name)
            self.add(name, fn)
        job = self._jobs[name]
        if self._claim(job):  # not started in the background: run it now
            self._run(job)
        job.done.wait()
        if job.error is not None:
            raise job.error
        return job.value

    def close(self) -> None:
        """Kill what is still running (an interrupted session) and remove the work dirs."""
        self._closed = True
        self._late.set()  # a thread waiting for late jobs ends
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)


#: The session's background jobs (``conftest.py`` starts and closes them).
BACKGROUND = Background()


def track(proc: subprocess.Popen) -> subprocess.Popen:
    """Register a job's subprocess, so that an interrupted session kills it."""
    BACKGROUND.procs.append(proc)
    return proc
