"""Test scaffolding, kept apart from the library: ``worlds.run_world`` (one spawned process per
rank) and ``local_plan.run_plan_locally`` (a plan executed inside one process). Production code
never imports this package (an import-linter contract in ``pyproject.toml``); tiny checkpoints
for tests and the demo are in :mod:`mcore_reshard.infra.checkpoint`."""
