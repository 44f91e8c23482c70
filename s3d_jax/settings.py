"""Settings read from the environment (`S3D_JAX_*`, docs/usage.md), parsed one way everywhere: a
bad value is a ValueError that names the variable. The bottom of the package: it imports nothing of it."""

from __future__ import annotations

import os

_ON, _OFF = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_switch(name: str) -> bool:
    """An on/off setting from the environment: unset or empty is on."""
    value = os.environ.get(name, "").strip().lower() or "1"
    if value not in _ON | _OFF:
        raise ValueError(f"{name}={os.environ[name]!r}: expected one of 1, 0, true, false, yes, no, on, off")
    return value in _ON


def env_setting(name: str, default: int, minimum: int) -> int:
    """A whole-number setting from the environment: `default` where unset."""
    value = os.environ.get(name)
    if value is None:
        return default
    if not value.strip().isdigit() or int(value) < minimum:
        raise ValueError(f"{name}={value!r}: expected a whole number >= {minimum}")
    return int(value)
