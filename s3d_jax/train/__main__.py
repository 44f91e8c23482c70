"""`python -m s3d_jax.train --config configs/smollm2.py [--config.a.b=value] [--workdir DIR] [--dry-run]`.

    --dry-run    check the config and print parameter counts and memory per device; allocates nothing
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from s3d_jax.sharding import maybe_initialize_distributed
from s3d_jax.train.config import unknown_field
from s3d_jax.train.dry_run import dry_run
from s3d_jax.train.loop import train


def main(argv=None) -> int:
    from absl import flags, logging
    from ml_collections import config_flags

    argv = [a.replace("--dry-run", "--dry_run") for a in (argv if argv is not None else sys.argv)]
    own = flags.FlagValues()  # not absl's global FLAGS, so that main() can run more than once in a process
    config_flag = config_flags.DEFINE_config_file("config", None, "training config (a Python file with get_config())",
                                                  flag_values=own, sys_argv=argv, lock_config=True)
    workdir_flag = flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)", flag_values=own)
    dry_flag = flags.DEFINE_bool("dry_run", False, "check the config and print parameter counts and memory; allocate nothing",
                                 flag_values=own)
    try:
        own(argv)
        if config_flag.value is None:
            raise flags.Error("--config is required, e.g. --config configs/smollm2.py")
        getattr(config_flag.value, "train", None)  # a config file that failed to load raises on first use
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a config file that does not load, or an override of a field it lacks
        print(f"error: {_config_problem(argv, e)}", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.WARNING)  # orbax logs every array it writes at INFO
    cfg = config_flag.value
    try:
        if dry_flag.value:
            print(json.dumps(dry_run(cfg), indent=2))
            return 0
        maybe_initialize_distributed()
        name = Path(own["config"].config_filename).stem
        out = train(cfg, workdir_flag.value or Path("runs") / name)
    except (ValueError, OSError) as e:  # ConfigError, CheckpointError and DataError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted: run the same command again to resume from the last checkpoint", file=sys.stderr)
        return 130
    print(f"trained drafter written to {out}")
    return 0


def _config_problem(argv: list[str], error: Exception) -> str:
    """What went wrong while the config file loaded or its overrides applied, in one clean line."""
    for arg in argv:
        if arg.startswith("--config."):
            problem = unknown_field(arg[len("--config."):].split("=", 1)[0])
            if problem:
                return f"{problem} ({arg})"
    config_file = next((a.split("=", 1)[1] for a in argv if a.startswith("--config=")), None)
    if config_file is None and "--config" in argv[:-1]:
        config_file = argv[argv.index("--config") + 1]
    if config_file and not Path(config_file).is_file():
        return f"the config file {config_file} does not exist"
    detail = str(error).strip().splitlines()
    return f"cannot load the config file {config_file}: {type(error).__name__}: {detail[-1] if detail else ''}"


if __name__ == "__main__":
    sys.exit(main())
