"""A vLLM server process (``python -m mcore_reshard.jobs.serve``) as the tests start it.

Under the fast start (``MCORE_RESHARD_FAST_START=1``, ``infra/procs.py``) the server is a child
of this process's fork server instead of a new interpreter: it runs the same entry point
(``jobs.serve.main``) with vLLM already imported, and forks its engine core (a fork-server
child does: ``adapters/vllm/fast_start.py``) instead of starting a fork server of its own that
imports vLLM again -- two imports of vLLM fewer per server. Off, it is the command a user
runs. Either way the server is the leader of a process group of its own (the tests stop it
and its engine core together) and writes its output to one log file.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Mapping, Sequence

from ..infra import procs

__all__ = ["ServerProcess", "start_server"]


class ServerProcess:
    """A server started from the fork server, with the part of ``subprocess.Popen`` the tests
    use: ``pid``, ``poll()``, ``wait(timeout)``."""

    def __init__(self, process: Any) -> None:
        self._process = process
        self.pid: int = process.pid

    def poll(self) -> int | None:
        return None if self._process.is_alive() else self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.is_alive():
            raise subprocess.TimeoutExpired(f"server pid {self.pid}", timeout or 0.0)
        return self._process.exitcode


def _serve(argv: list[str], env: dict[str, str], log_path: str) -> None:
    """In the fork-server child: a process group of its own, the log as stdout and stderr,
    the server's environment, then the server's own entry point."""
    os.setsid()
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.clear()
    os.environ.update(env)
    from ..jobs.serve import main

    main(argv)  # multiprocessing flushes stdout and stderr when the child's target returns


def start_server(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> ServerProcess | subprocess.Popen:
    """Start ``python -m mcore_reshard.jobs.serve *argv`` with ``env``, its output in
    ``log_path``: from the fork server when ``env`` turns the fast start on, else a new
    interpreter."""
    if env.get(procs.ENV) == "1":
        child = procs.context().Process(target=_serve, args=(list(argv), dict(env), str(log_path)),
                                        name="mcore-reshard-serve")
        child.start()
        return ServerProcess(child)
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "mcore_reshard.jobs.serve", *argv], env=dict(env),
                                stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
