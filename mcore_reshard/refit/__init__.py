"""Refit orchestration: the driver, what it knows of an engine, what a refit measured, full
verification, the transports it runs (``transports/``: reshard, the HF-broadcast baseline) and
the HTTP controller (``servers``)."""
