"""Helpers for tests and the demo: tiny random-weight HF checkpoints built locally (no hub)."""
