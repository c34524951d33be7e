"""Where settings come from, each with its own override grammar, turned into one plain dict
for the reader: a Hydra config under ``configs/`` (Hydra's overrides, struct mode) and a
recipe YAML (``a.b.c=value`` / ``+a.b.c=value``, then ``${...}`` interpolations resolved).

Every bad file or override raises :class:`~mcore_reshard.errors.ConfigError` with one line.
"""

from __future__ import annotations

import copy
import re
from pathlib import Path
from typing import Any, Mapping, Sequence

import yaml

from ..errors import ConfigError
from ..wire.protocol import one_line
from .models import CONFIG_DIR
from .reader import container
from .schema import KNOWN_KEYS

__all__ = ["compose", "load_config", "read_recipe_file", "resolve_recipe", "apply_overrides", "load_recipe"]


# --------------------------------------------------------------------------- Hydra


def _hydra_message(exc: BaseException, config_name: str, overrides: Sequence[str]) -> str:
    text = f"{exc}\n{exc.__cause__ or ''}"
    m = re.search(r"Could not override '([^']+)'", text)
    if m and "not in struct" in text:
        return f"unknown setting {m.group(1)}: configs/{config_name}.yaml has no such key"
    m = re.search(r"An item is already at '([^']+)'", text)
    if m:
        return f"{m.group(1)} is already a setting: drop the '+' (+{m.group(1)}=...)"
    if type(exc).__name__ == "OverrideParseException":
        from hydra.core.override_parser.overrides_parser import OverridesParser

        parser = OverridesParser.create()
        for o in overrides:  # name the override hydra could not parse
            try:
                parser.parse_overrides([o])
            except Exception as inner:  # noqa: BLE001
                return f"cannot parse override {o!r}: {one_line(inner)}"
    return f"configs/{config_name}.yaml: {one_line(exc)}"


def _check_keys(cfg: Any, base: Any, prefix: str, config_name: str, open_sections: Sequence[str]) -> None:
    """Keys added with ``+`` that the YAML does not have, and keys removed with ``~``."""
    from omegaconf import DictConfig

    for key in cfg:
        path = f"{prefix}{key}"
        if key not in base:
            if prefix.rstrip(".") in open_sections:
                continue  # a dataclass section: build_dataclass names unknown fields
            raise ConfigError(f"unknown setting {path}: configs/{config_name}.yaml has no such key "
                              f"(known here: {sorted(str(k) for k in base)})")
        if isinstance(cfg[key], DictConfig) and isinstance(base[key], DictConfig):
            _check_keys(cfg[key], base[key], path + ".", config_name, open_sections)
    for key in base:
        if key != "defaults" and key not in cfg:
            path = f"{prefix}{key}"
            raise ConfigError(f"{path} was removed (~{path}): configs/{config_name}.yaml needs every key it lists")


def compose(config_name: str, overrides: Sequence[str] = (), *, open_sections: Sequence[str] = ()) -> Any:
    """Hydra compose (struct mode: an unknown key is an error, not a silent no-op).

    A key added with ``+`` must exist in the YAML too, except inside ``open_sections`` (the
    sections read as dataclasses, whose reader names unknown fields).
    """
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    path = CONFIG_DIR / f"{config_name}.yaml"
    try:
        with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
            cfg = hydra_compose(config_name=config_name, overrides=list(overrides))
        base = OmegaConf.load(path)
    except Exception as exc:  # noqa: BLE001 - hydra/omegaconf errors are bad input
        if type(exc).__module__.split(".")[0] in ("hydra", "omegaconf", "yaml"):
            raise ConfigError(_hydra_message(exc, config_name, overrides)) from None
        raise
    OmegaConf.set_struct(cfg, True)
    container(cfg, f"configs/{config_name}.yaml")  # interpolations resolve, or the key is named
    _check_keys(cfg, base, "", config_name, open_sections)
    return cfg


def load_config(config_name: str, overrides: Sequence[str] = (), *, open_sections: Sequence[str] = ()) -> dict:
    """``configs/<config_name>.yaml`` + Hydra overrides as a plain dict (see :func:`compose`)."""
    cfg = compose(config_name, overrides, open_sections=open_sections)
    return container(cfg, f"configs/{config_name}.yaml")


# --------------------------------------------------------------------------- recipe YAML


def read_recipe_file(path: str | Path, what: str | None = None) -> dict:
    """A recipe file as a plain dict, interpolations not yet resolved (so overrides can be
    applied first); ``what`` names the file in errors (default ``--recipe 'PATH'``)."""
    what = what or f"--recipe {str(path)!r}"
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"{what}: " + ("a directory, not a file" if p.is_dir() else "no such file"))
    try:
        loaded = yaml.safe_load(p.read_text())
    except (yaml.YAMLError, UnicodeDecodeError, OSError) as exc:
        raise ConfigError(f"{what} is not YAML: {one_line(exc)}") from None
    if not isinstance(loaded, Mapping):
        kind = "empty" if loaded is None else f"a {type(loaded).__name__}"
        raise ConfigError(f"{what}: the top level is {kind}, not a mapping (policy:, cluster:, ...)")
    return dict(loaded)


def resolve_recipe(loaded: Mapping[str, Any], what: str) -> dict:
    """``loaded`` with its ``${...}`` interpolations resolved (NeMo RL recipes use them)."""
    from omegaconf import OmegaConf

    try:
        node = OmegaConf.create(dict(loaded))
    except Exception as exc:  # noqa: BLE001 - e.g. non-string keys
        raise ConfigError(f"{what}: {one_line(exc)}") from None
    return container(node, what)


def _parse_override(o: str) -> tuple[bool, list[str], Any]:
    """``[+]a.b.c=value`` as (add, key parts as written, value parsed as YAML)."""
    add = o.startswith("+")
    key, sep, raw = (o[1:] if add else o).partition("=")
    parts = key.strip().split(".")
    if not sep or not all(p.strip() for p in parts):
        raise ConfigError(f"override {o!r} is not key.path=value (e.g. grpo.max_num_steps=3)")
    try:
        return add, parts, yaml.safe_load(raw)
    except yaml.YAMLError as exc:
        raise ConfigError(f"override {o!r}: the value is not YAML: {one_line(exc)}") from None


def apply_overrides(data: Mapping[str, Any], overrides: Sequence[str],
                    known: frozenset[str] = KNOWN_KEYS) -> dict:
    """``data`` with each ``a.b.c=value`` set (values parsed as YAML: ``3`` is an int, ``null``
    is None, ``${x.y}`` an interpolation resolved later). A key must be in the recipe or in
    ``known`` (the keys the recipe schema reads, so a typo is an error instead of a setting
    nobody reads); ``+a.b.c=value`` adds a key the recipe does not have (Hydra's rule)."""
    out = copy.deepcopy(dict(data))
    for o in overrides:
        add, parts, value = _parse_override(o)
        key = ".".join(p.strip() for p in parts)
        node = out
        for i, p in enumerate(parts[:-1]):
            p = p.strip()
            here = ".".join(parts[: i + 1])
            if node.get(p) is None and (add or key in known):
                node[p] = {}
            elif p not in node:
                raise ConfigError(f"unknown setting {key}: the recipe has no {here} (add it with +{key}=...)")
            if not isinstance(node[p], dict):
                raise ConfigError(f"override {o!r}: {here} is a {type(node[p]).__name__}, not a mapping")
            node = node[p]
        leaf = parts[-1].strip()
        if add and leaf in node:
            raise ConfigError(f"{key} is already a setting: drop the '+' (+{key}=...)")
        if not add and leaf not in node and key not in known:
            raise ConfigError(f"unknown setting {key}: the recipe has no such key (add it with +{key}=...)")
        node[leaf] = value
    return out


def load_recipe(path: str | Path, overrides: Sequence[str] = (), *, what: str | None = None) -> dict:
    """The recipe at ``path`` with ``overrides`` applied and interpolations resolved, as a
    plain dict; ``what`` names the file in errors (default ``--recipe 'PATH'``)."""
    what = what or f"--recipe {str(path)!r}"
    return resolve_recipe(apply_overrides(read_recipe_file(path, what), overrides), what)
