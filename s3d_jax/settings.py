"""Settings read from the environment (`S3D_JAX_*`, docs/usage.md), parsed one way everywhere: a
bad value is a ValueError that names the variable; and the cores this process may use. The bottom of
the package: it imports nothing of it."""

from __future__ import annotations

import os

_ON, _OFF = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


def env_switch(name: str, default: bool = True) -> bool:
    """An on/off setting from the environment: unset or empty is `default`."""
    value = os.environ.get(name, "").strip().lower() or ("1" if default else "0")
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


def usable_cores() -> int:
    """The CPUs this process may run on (its affinity where the OS says, else all)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
