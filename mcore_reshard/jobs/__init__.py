"""The jobs, the top layer below the CLI: a local refit (``refit``: trainer processes and vLLM
engines on this machine, ``mcore-reshard refit``), GRPO on Ray (``grpo``: ``mcore-reshard
grpo``) and vLLM's HTTP server with the refit backend (``serve``: ``python -m
mcore_reshard.jobs.serve``). Each composes the refit orchestration below it (driver, rank
protocol, verification) and is imported by nothing but the CLI and its tests."""
