"""vLLM's trainer-side weight-sync client as a refit destination.

A framework written against vLLM's trainer API reaches its engine through a
``VLLMWeightSyncClient`` (``HTTPVLLMWeightSyncClient``, ``RayVLLMWeightSyncClient``): init, start,
update, finish -- no pause, no status. ``WeightSyncClient`` is that client as a
``transport.destination.Destination``, so vLLM's trainer API runs the same refit sequence as
the driver and the HTTP controller. Its engine cannot be asked what its workers hold: a refit
is confirmed by its own outcome, and a worker that could not learn a refit's decision refuses
model steps until a refit commits (the applier's own gate: there is no pause to hold).
"""

from __future__ import annotations

from typing import Any

from ....errors import ConfigError, RefitFailed
from ....layout import ModelSpec
from ....transport.destination import Described, DestinationInfo
from ....wire.protocol import WorkerStatus

__all__ = ["WeightSyncClient"]


class WeightSyncClient:
    """``client`` (vLLM's ``VLLMWeightSyncClient``) as a refit destination (see the module
    docstring); ``world_size``: the engine's workers."""

    def __init__(self, client: Any, world_size: int) -> None:
        self.client, self.world_size = client, world_size

    def info(self) -> DestinationInfo:
        return DestinationInfo(self.world_size, "", name=type(self.client).__name__)

    def describe(self, spec: ModelSpec) -> Described:
        raise RefitFailed("vLLM's weight-sync client cannot ask the engine what its workers hold: the trainers plan "
                          "against its layout by the rules (ReshardTrainerInitInfo.engine_*)")

    def learn_draft(self) -> None:
        """An engine that drafts learns where its draft is through vLLM's draft session
        (``start_draft_weight_update`` then ``finish_weight_update``, nothing sent); from then
        on every refit moves target and draft in one vote. vLLM's clients have no call for the
        draft session: the client's own ``start_draft_weight_update`` where it has one, else
        the server's ``/start_draft_weight_update`` route through the HTTP client's post."""
        start = getattr(self.client, "start_draft_weight_update", None)
        post = getattr(self.client, "_post", None)
        if start is None and callable(post):  # vLLM's HTTPVLLMWeightSyncClient
            start = lambda: post("start_draft_weight_update")  # noqa: E731
        if start is None:
            raise ConfigError(f"engine_speculative_config: {type(self.client).__name__} has no call for vLLM's draft "
                              f"session (start_draft_weight_update): the engine cannot learn its draft")
        start()
        self.client.finish_weight_update()

    def join(self, init: Any) -> None:
        self.client.init_weight_transfer_engine(init.to_wire() if hasattr(init, "to_wire") else init)

    def pause(self, swap: bool) -> None:
        """vLLM's trainer API has no pause: the engine serves its old weights until the swap at
        ``finish_weight_update`` (one step boundary)."""

    def begin(self) -> None:
        self.client.start_weight_update()

    def transfer(self, update: Any) -> None:
        self.client.update_weights(update.to_wire() if hasattr(update, "to_wire") else update)

    def conclude(self, version: str | None) -> None:
        self.client.finish_weight_update(weight_version=version)

    def status(self) -> list[WorkerStatus] | None:
        return None

    def refresh(self, version: str, recompute: bool = False, encoders: bool = False) -> str:
        """The label was set by ``finish_weight_update``. The client has no call that drops the
        KV cached under the old weights (nor a multimodal encoder's outputs): the note says so
        (requests should carry the version as their ``cache_salt``, and their images' uuids)."""
        note = ("prefix cache not reset: vLLM's weight-sync client has no call for it (send the weight version "
                "as each request's cache_salt)")
        if encoders:
            note += ("; encoder cache not reset either (the vision tower or projector changed: send the weight "
                     "version in each image's multi_modal_uuids)")
        return note

    def resume(self) -> None:
        """Nothing was paused."""

    def close(self) -> None:
        self.client.shutdown_weight_transfer_engine()
