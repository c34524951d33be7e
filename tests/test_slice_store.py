"""Plan slices by digest through a real ``TCPStore`` (what a refit group's store is): a
worker gets its own slice, checked against the digest the init info named."""

from __future__ import annotations

import json
from datetime import timedelta

import pytest
import torch.distributed as dist

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_layout
from mcore_reshard.adapters.vllm.rules import VllmParallel, vllm_layout
from mcore_reshard.infra.checkpoint import tiny_config
from mcore_reshard.errors import RefitError
from mcore_reshard.layout import spec_from_hf_config
from mcore_reshard.plan import build_plan
from mcore_reshard.plan.wire import slice_from_wire, slice_to_wire
from mcore_reshard.infra.ports import free_port
from mcore_reshard.wire.slice_store import fetch_slice, publish_slices, slice_key


@pytest.fixture
def store():
    s = dist.TCPStore("127.0.0.1", free_port(), 1, True, timedelta(seconds=10))
    yield dist.PrefixStore("mcore_reshard/refit", s)


def test_each_rank_reads_its_own_slice_by_digest(store):
    spec = spec_from_hf_config(tiny_config("qwen3_moe"))
    plan = build_plan(megatron_layout(spec, MegatronParallel(tp=2, ep=2, etp=1)), vllm_layout(spec, VllmParallel(tp=2)))
    wires = {str(r): slice_to_wire(plan.for_rank("dst", r)) for r in range(plan.num_dst)}
    digests = publish_slices(store, wires)
    assert set(digests) == set(wires) and all(len(d) == 16 for d in digests.values())
    assert len(json.dumps(digests)) < len(json.dumps(wires)) / 10
    for r, d in digests.items():
        s = slice_from_wire(fetch_slice(store, d, 1.0))
        assert (s.side, s.rank, s.digest()) == ("dst", int(r), d)


def test_missing_or_substituted_slice_is_one_line_naming_the_rank(store):
    with pytest.raises(RefitError, match=r"^vLLM destination rank 3: plan slice 0000000000000000 not published .* 0.2s"):
        fetch_slice(store, "0" * 64, 0.2, "vLLM destination rank 3")
    store.set(slice_key("a" * 64), json.dumps({"digest": "b" * 64}))
    with pytest.raises(RefitError, match=r"holds 'bbbb.*' under plan slice aaaa"):
        fetch_slice(store, "a" * 64, 1.0)
    with pytest.raises(ValueError, match=r"digest='x/y'"):
        slice_key("x/y")
