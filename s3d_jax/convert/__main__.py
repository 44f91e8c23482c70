"""`python -m s3d_jax.convert SRC OUT [--to-hf]`: see `s3d_jax.convert`."""

import sys

from s3d_jax.convert import main

sys.exit(main())
