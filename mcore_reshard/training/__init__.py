"""The training side as a driver and the jobs reach it: the typed rank calls (``ranks``), the
local trainer group (``pool``) and the GRPO losses (``losses``)."""
