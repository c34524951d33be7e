"""The ways a driver moves one refit's bytes: ``reshard`` (the plan, shard to shard) and
``hf_broadcast`` (the baseline). Neither imports the driver nor the other."""
