"""The speedup predictor's command line, `python -m s3d_jax.predict` (see `__main__.py`); the model
itself is `s3d_jax.speedup`."""
