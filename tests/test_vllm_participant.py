"""``VllmApplier`` as the refit's participant (``transport.participant.Participant``), on a plain
torch module whose parameters vLLM would keep in model format (``direct``): what each of
``open``, ``prepare``, ``commit`` and ``abort`` leaves served, and the worker's own gate --
no model step runs on a torn model, nor on a worker that could not learn a refit's decision
(``unsure``: its engine's other workers may hold the new weights). The live engines take the
same calls in ``test_faults.py`` and ``test_http_server.py``."""

from __future__ import annotations

import pytest
import torch

from mcore_reshard.layout.descriptor import Box, LocalParam, Piece, View
from mcore_reshard.wire.protocol import RefitRequest

pytestmark = pytest.mark.heavy  # imports vLLM (~5 s)


def _whole(name: str, shape: tuple[int, ...]) -> LocalParam:
    strides = tuple(int(torch.empty(shape).stride(i)) for i in range(len(shape)))
    return LocalParam(0, name, shape, "float32", (Piece(0, name, name, Box((0,) * len(shape), shape),
                                                        View(0, shape, strides)),))


def _applier(atomic: bool):
    from mcore_reshard.adapters.vllm.apply import DIRECT, VllmApplier

    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    params = [_whole("0.weight", (3, 4)), _whole("0.bias", (3,))]
    return model, VllmApplier(model, params, modes={p.name: DIRECT for p in params}, atomic=atomic)


def _receive(applier, value: float) -> None:
    """What the transport does between ``open`` and ``prepare``: every box written."""
    for name, lp in applier.params.items():
        applier.write(name, lp.pieces[0].view, torch.full(lp.shape, value))


def test_atomic_participant_serves_the_old_weights_until_commit_and_after_an_abort():
    from mcore_reshard.errors import RefitIncomplete

    model, ap = _applier(atomic=True)
    x = torch.ones(1, 4)
    old = model(x).clone()
    assert ap.open(RefitRequest("d")) is False  # no model-format baseline kept yet: no delta
    _receive(ap, 1.0)
    ready = ap.prepare()
    assert set(ready.phases) >= {"apply_finish"} and ready.held_bytes == 0  # held only when overlapped
    assert torch.equal(model(x), old)  # prepared: nothing served changed
    ap.commit()
    assert torch.equal(model(x), torch.full((1, 3), 5.0)) and ap.state == "serving"

    ap.open(RefitRequest("d"))
    _receive(ap, 2.0)
    ap.prepare()
    ap.abort("aborted: another rank said no")  # the vote said no: the staged copies are dropped
    assert torch.equal(model(x), torch.full((1, 3), 5.0)) and ap.state == "serving"

    ap.unsure = "decision unknown: the store's host died"  # what the engine sets after such a vote
    with pytest.raises(RefitIncomplete, match="does not know whether its engine's other workers committed"):
        model(x)
    ap.unsure = ""  # a refit that commits here clears it (the engine's ``_conclude``)
    assert torch.equal(model(x), torch.full((1, 3), 5.0))


def test_streaming_participant_aborted_after_prepare_refuses_model_steps():
    """A streaming refit goes live at ``prepare``; when the vote then says no, the worker holds
    weights no one else does and must not serve them."""
    from mcore_reshard.errors import RefitIncomplete

    model, ap = _applier(atomic=False)
    x = torch.ones(1, 4)
    ap.open(RefitRequest("d", atomic=False))
    _receive(ap, 1.0)
    ap.prepare()
    assert torch.equal(model(x), torch.full((1, 3), 5.0))  # live already
    ap.abort("aborted: a checksum mismatch on another rank")
    assert ap.state == "not_serving"
    with pytest.raises(RefitIncomplete, match="model step refused"):
        model(x)
    ap.abort("a second abort of the same refit")  # never raises, and changes nothing more
    assert ap.state == "not_serving"
