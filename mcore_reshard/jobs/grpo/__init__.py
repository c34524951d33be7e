"""GRPO on Ray with mcore-reshard refits: recipes (``recipe``), the metadata-only dry run
(``dry_run``) and the loop itself (``loop``, ``ray_cluster``).

Kept free of imports so that ``mcore-reshard grpo --dry-run`` and the recipe checks never
pull in Ray, torch or vLLM.
"""
