"""Settings: one schema (``schema``) and one reader (``reader``) for the CLI's Hydra configs
and the GRPO recipe YAML (``sources`` turns each, with its own override grammar, into a plain
dict). Every bad setting raises :class:`~mcore_reshard.errors.ConfigError` with one line
naming the key, before anything starts."""

from ..errors import ConfigError
from .limits import (MAX_LOCAL_PROCESSES, MAX_PLAN_TRANSFERS, MAX_WORLD, check_world, local_cpu_problem,
                     local_train_problem)
from .models import (CONFIG_DIR, LOCAL_DTYPES, TINY_MODELS, check_dtype, is_checkpoint_dir, load_spec,
                     resolve_model, tiny_spec)
from .reader import (REQUIRED, Field, Section, build_dataclass, check_type, container, keys, lookup, read,
                     read_mapping, read_section, sections)
from .schema import (KNOWN_KEYS, PLAN_CONFIG, RECIPE, REFIT_CONFIG, ClusterSettings, GenerationSettings,
                     AsyncGrpoSettings, GrpoSettings, LossSettings, RaySettings, RecipeLayout, RefitConfig,
                     TaskSettings, ColourTaskSettings)
from .sources import apply_overrides, compose, load_config, load_recipe, read_recipe_file, resolve_recipe

__all__ = [
    "ConfigError",
    # limits
    "MAX_LOCAL_PROCESSES", "MAX_PLAN_TRANSFERS", "MAX_WORLD", "check_world", "local_cpu_problem", "local_train_problem",
    # models
    "CONFIG_DIR", "LOCAL_DTYPES", "TINY_MODELS", "check_dtype", "is_checkpoint_dir", "load_spec", "resolve_model",
    "tiny_spec",
    # the reader
    "REQUIRED", "Field", "Section", "build_dataclass", "check_type", "container", "keys", "lookup", "read",
    "read_mapping", "read_section", "sections",
    # the schema
    "KNOWN_KEYS", "PLAN_CONFIG", "RECIPE", "REFIT_CONFIG", "ClusterSettings", "GenerationSettings", "GrpoSettings",
    "AsyncGrpoSettings", "LossSettings", "RaySettings", "RecipeLayout", "RefitConfig", "TaskSettings", "ColourTaskSettings",
    # the sources
    "apply_overrides", "compose", "load_config", "load_recipe", "read_recipe_file", "resolve_recipe",
]
