"""Transport: moves a plan's bytes (in-process for tests, torch.distributed P2P for refits)."""
