"""``MCORE_RESHARD_VLLM_SPIN_S`` (``mcore_reshard/adapters/vllm/spin.py``): vLLM's own
shared-memory queue readers, built as vLLM's ``MessageQueue`` builds them, spin for the seconds
the variable says; unset, vLLM's class is left alone (its 1 s); a bad value is one line naming
the variable. (The test session sets it for every engine it starts: ``conftest.py``.)"""

from __future__ import annotations

import pytest
import zmq

from mcore_reshard.adapters.vllm import spin
from mcore_reshard.errors import ConfigError


@pytest.fixture
def reader(monkeypatch, tmp_path):
    """``make(value)``: ``spin.install()`` under the variable's ``value`` (None: unset) on vLLM's
    class as vLLM ships it, then a reader ``SpinCondition`` built as ``MessageQueue`` builds one.
    This process's own patch (the session's value) is put back afterwards."""
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    saved_init, saved_state = SpinCondition.__init__, dict(spin._INSTALLED)
    if "init" in spin._INSTALLED:
        SpinCondition.__init__ = spin._INSTALLED["init"]
    spin._INSTALLED.clear()
    made = []

    def make(value: str | None):
        if value is None:
            monkeypatch.delenv(spin.ENV, raising=False)
        else:
            monkeypatch.setenv(spin.ENV, value)
        spin.install()
        ctx = zmq.Context()
        made.append(ctx)
        cond = SpinCondition(is_reader=True, context=ctx, notify_address=f"ipc://{tmp_path}/notify-{len(made)}")
        for sock in (cond.local_notify_socket, cond.read_cancel_socket, cond.write_cancel_socket):
            sock.close(linger=0)
        return cond

    try:
        yield make
    finally:
        for ctx in made:
            ctx.term()
        SpinCondition.__init__ = saved_init
        spin._INSTALLED.clear()
        spin._INSTALLED.update(saved_state)


def test_readers_spin_for_the_seconds_set(reader):
    assert reader("0.25").busy_loop_s == 0.25
    assert reader("0").busy_loop_s == 0.0  # a later value wins, the class patched once
    assert reader("0.05").busy_loop_s == 0.05


def test_unset_leaves_vllms_class_alone(reader):
    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    shipped = SpinCondition.__init__
    assert reader(None).busy_loop_s == 1  # vLLM's own default
    assert SpinCondition.__init__ is shipped and not spin._INSTALLED


@pytest.mark.parametrize("value", ["-1", "fast", "inf", "nan"])
def test_bad_value_is_one_line_naming_the_variable(value, monkeypatch):
    monkeypatch.setenv(spin.ENV, value)
    with pytest.raises(ConfigError) as err:
        spin.install()
    msg = str(err.value)
    assert msg.startswith(f"{spin.ENV}={value!r}") and "seconds" in msg and "\n" not in msg
