"""Test support shared by the test modules (never import helpers from another ``test_*.py``).

- ``support.worlds``: small gloo worlds of spawned ranks for transport tests (``spawn_ranks``,
  ``ship``), toy tensors and the one-refit helper every such world runs (``refit_once``).
- ``support.megatron``: ``run_world`` on warm megatron worlds (rank processes kept between
  jobs, keyed by world size; a failed job's world is killed and the next job gets a new one).
- ``support.live``: session caches of what the live tests start, keyed by what makes them
  differ: tiny checkpoints (model, dtype, seed), vLLM engines (model, dtype, TP, EP, apply
  mode, weight-transfer backend) and megatron trainer pools (checkpoint, dtype, layout,
  training settings), plus ``cluster()``: a refit driver over a cached pool and engines.

``conftest.py`` owns their lifetimes (closed at session end) and orders the tests so that the
ones sharing an engine or a pool run together.
"""

import threading

#: Held while the session's background starts processes outside a test (the warm megatron
#: worlds): a test that checks that a call started no process holds it around its check, so a
#: process the background starts meanwhile is not taken for one the call started.
PROCESS_STARTS = threading.Lock()
