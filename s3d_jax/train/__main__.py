"""`python -m s3d_jax.train --config configs/smollm2.py [--config.a.b=value] [--workdir DIR] [--dry-run]`.

    --dry-run    check the config and print parameter counts and memory per device; allocates nothing
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from s3d_jax.sharding import maybe_initialize_distributed
from s3d_jax.train.dry_run import dry_run
from s3d_jax.train.loop import train


def main(argv=None) -> int:
    from absl import flags, logging
    from ml_collections import config_flags

    argv = [a.replace("--dry-run", "--dry_run") for a in (argv if argv is not None else sys.argv)]
    config_flag = config_flags.DEFINE_config_file("config", None, "training config (a Python file with get_config())", lock_config=True)
    workdir_flag = flags.DEFINE_string("workdir", None, "run directory (default: runs/<config name>)")
    dry_flag = flags.DEFINE_bool("dry_run", False, "check the config and print parameter counts and memory; allocate nothing")
    try:
        flags.FLAGS(argv)
        if config_flag.value is None:
            raise flags.Error("--config is required, e.g. --config configs/smollm2.py")
    except flags.Error as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (AttributeError, KeyError) as e:  # an override of a field the config does not have
        name = str(e).strip("'\"")
        given = [a for a in argv if a.startswith("--config.") and name in a]
        print(f"error: the config has no field {name!r} ({' '.join(given) or 'in an override'})", file=sys.stderr)
        return 2
    logging.set_verbosity(logging.WARNING)  # orbax logs every array it writes at INFO
    cfg = config_flag.value
    try:
        if dry_flag.value:
            print(json.dumps(dry_run(cfg), indent=2))
            return 0
        maybe_initialize_distributed()
        name = Path(flags.FLAGS["config"].config_filename).stem
        out = train(cfg, workdir_flag.value or Path("runs") / name)
    except ValueError as e:  # ConfigError, CheckpointError and DataError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trained drafter written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
