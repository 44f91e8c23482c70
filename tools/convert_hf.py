"""Converts a Hugging Face model directory or a llama GGUF file into an s3d_jax model directory, and back.

    python tools/convert_hf.py SRC OUT [--dtype float32|bfloat16|float16|int8|int4] [--quiet] [--overwrite]
    python tools/convert_hf.py MODEL HF_OUT --to-hf      # back to transformers, e.g. a trained drafter
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from s3d_jax.convert import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
