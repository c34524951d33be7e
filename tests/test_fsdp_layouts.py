"""Megatron-FSDP layouts (no processes): a rank holding rows of megatron's local tensors
(``layout.rows``), and the rules' prediction of Megatron-FSDP's shards (``megatron_rank_params``
with ``fsdp``), element by element."""

from __future__ import annotations

import itertools
import random

import pytest

from mcore_reshard.adapters.megatron.rules import MegatronParallel, megatron_rank_params
from mcore_reshard.infra.checkpoint import TINY_DENSE, TINY_MOE
from mcore_reshard.layout import Box, LayoutError, LocalParam, Piece, View, spec_from_hf_config
from mcore_reshard.layout.rows import rows_of


def _elements(lp: LocalParam) -> dict[int, tuple[str, tuple[int, ...]]]:
    """Local flat index -> (canonical tensor, global index), for every element a piece covers."""
    out = {}
    for q in lp.pieces:
        for idx in itertools.product(*(range(n) for n in q.box.sizes)):
            flat = q.view.offset + sum(i * s for i, s in zip(idx, q.view.stride))
            glob = tuple(o + i for o, i in zip(q.box.offsets, idx))
            assert flat not in out, f"{lp.name}: local element {flat} covered twice"
            out[flat] = (q.canonical, glob)
    return out


def _cuts(total: int, parts: int, rng: random.Random) -> list[tuple[int, int]]:
    points = sorted(rng.randint(0, total) for _ in range(parts - 1))
    bounds = [0, *points, total]
    return [(a, b - a) for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("config,par", [
    (TINY_DENSE, MegatronParallel(tp=1)),
    (TINY_DENSE, MegatronParallel(tp=2)),
    (TINY_MOE, MegatronParallel(tp=2, ep=2, dp=2)),
    (TINY_MOE, MegatronParallel(tp=2, ep=1, experts="grouped")),
], ids=["dense-tp1", "dense-tp2", "moe-tp2-ep2", "moe-tp2-grouped"])
def test_rows_of_a_param_are_exactly_its_elements_in_those_rows(config, par):
    """Any cut of every parameter's rows: each part's pieces hold exactly the original's
    elements in its rows (re-based on them), and the parts together hold every element once."""
    # one narrow layer and a 200-token vocab (padded to 256 rows: padding rows are cut too)
    spec = spec_from_hf_config(dict(config, num_hidden_layers=1, vocab_size=200, hidden_size=32, intermediate_size=64,
                                    moe_intermediate_size=32), dtype="float32")
    rng = random.Random(7)
    for lp in megatron_rank_params(spec, par, 0):
        whole = _elements(lp)
        row_len = lp.numel // lp.shape[0]
        for parts in (2, 3):
            seen = {}
            for start, rows in _cuts(lp.shape[0], parts, rng):
                part = rows_of(lp, start, rows)
                assert part.shape == (rows, *lp.shape[1:])
                for flat, where in _elements(part).items():
                    seen[flat + start * row_len] = where
                want = {f: w for f, w in whole.items() if start * row_len <= f < (start + rows) * row_len}
                got = {f + start * row_len: w for f, w in _elements(part).items()}
                assert got == want, f"{lp.name}: rows [{start}, {start + rows})"
            assert seen == whole, lp.name


def test_a_cut_inside_a_row_of_a_piece_is_refused_in_one_line():
    """A piece laid along the flat storage across rows (no box dimension walks the rows) cannot
    be cut between rows: one line naming the tensor and the rows."""
    lp = LocalParam(0, "w", (4, 2), "float32", (Piece(0, "w", "model.x", Box((0,), (8,)), View(0, (8,), (1,))),))
    assert rows_of(lp, 0, 4).pieces[0].box == Box((0,), (8,))
    with pytest.raises(LayoutError, match=r"^w: rows \[1, 3\) of the local tensor cut its piece of model.x"):
        rows_of(lp, 1, 2)
    with pytest.raises(LayoutError, match=r"w: rows \[3, 5\) are not within its 4 rows"):
        rows_of(lp, 3, 2)


def test_the_rules_place_megatron_fsdps_buckets():
    """The rules' Megatron-FSDP slices (``fsdp_rules``, checked against the live buffers in
    ``test_megatron_fsdp``): each rank holds rows of its own; together the data-parallel ranks
    of one TP position hold each element once; a bucket is split evenly, the first rank's slice
    of the tiny model's layer 0 QKV is 130 of TP rank 0's 192 rows (Megatron-FSDP's packing of
    the layer's bucket, padded to a chunk of 64 per rank)."""
    spec = spec_from_hf_config(TINY_DENSE, dtype="float32")
    whole = {p.name: p for p in megatron_rank_params(spec, MegatronParallel(tp=2, dp=2), 0)}
    mine = {r: {p.name: p for p in megatron_rank_params(spec, MegatronParallel(tp=2, dp=2, fsdp=True), r)}
            for r in (0, 2)}  # TP rank 0 at DP ranks 0 and 1
    qkv = "decoder.layers.0.self_attention.linear_qkv.weight"
    assert (mine[0][qkv].shape, mine[2][qkv].shape) == ((130, 64), (62, 64))
    for name, p in whole.items():
        assert mine[0][name].shape[0] + mine[2][name].shape[0] == p.shape[0], name
        assert sum(q.numel for r in (0, 2) for q in mine[r][name].pieces) == sum(q.numel for q in p.pieces), name


def test_megatron_fsdp_with_pipeline_stages_is_refused_in_one_line():
    spec = spec_from_hf_config(TINY_DENSE, dtype="float32")
    with pytest.raises(LayoutError, match=r"^Megatron-FSDP with pipeline_model_parallel_size=2: .* use pp=1$"):
        megatron_rank_params(spec, MegatronParallel(pp=2, dp=2, fsdp=True), 0)


def test_a_bucket_that_cuts_a_parameter_inside_a_row_is_refused_in_one_line():
    """Megatron-FSDP's packing of one layer holding a (1, 3) and a (2, 2) parameter: the chunk
    is lcm(3, 2) = 6 elements, both are smaller (fragments, packed back to back: 7 elements),
    and the bucket padded to 2 x 6 gives data-parallel rank 0 elements [0, 6) -- three of the
    (2, 2) parameter's four, one and a half rows. No box describes that (megatron's own
    ``view(-1, 2)`` of the slice fails too): one line naming the parameter, before a plan."""
    from mcore_reshard.adapters.megatron.fsdp_rules import fsdp_slices

    params = [LocalParam(0, "decoder.layers.0.a.weight", (1, 3), "float32", ()),
              LocalParam(0, "decoder.layers.0.b.weight", (2, 2), "float32", ())]
    with pytest.raises(LayoutError, match=r"^decoder.layers.0.b.weight: Megatron-FSDP's bucket gives data-parallel "
                                          r"rank 0 its elements \[0, 3\) of \(2, 2\), not whole rows of 2: a bucket "
                                          r"the planner cannot cut$"):
        fsdp_slices(params, {False: (0, 2), True: (0, 1)})
    # one data-parallel rank: nothing is cut
    assert fsdp_slices(params, {False: (0, 1), True: (0, 1)}) == {"decoder.layers.0.a.weight": (0, 1),
                                                                  "decoder.layers.0.b.weight": (0, 2)}
