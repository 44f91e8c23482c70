"""The CPU kernel beneath `s3d_jax.ops`: `few_rows.cc`, XLA FFI handlers for a decode pass's products
of a few rows, its attention over the KV cache and its vocabulary-table lookups (docs/cpu.md).

- `build`: compiling the source once per machine into the cache, keyed and checked by digest;
- `ffi`: the switch, registering the handlers with XLA and the calls into them, with their JVP rules;
- `dispatch`: when a product goes to the kernel, and XLA's fallback where it does not.

Nothing here knows the model: `s3d_jax.ops` is the one module the model calls.
"""
