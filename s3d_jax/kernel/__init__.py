"""The CPU kernel beneath `s3d_jax.ops`: `cc/`, XLA FFI handlers for a decode pass's products of a
few rows (`float_products.cc`, `int8_products.cc`, `int4_products.cc`), its attention over the KV
cache (`attention.cc`) and its vocabulary-table lookups (`lookups.cc`), sharing helper threads
(`threads.cc`) and what `few_rows.h` holds (docs/cpu.md).

- `build`: compiling those files once per machine, side by side, into one library in the cache,
  keyed and checked by digest;
- `ffi`: the switch, registering the handlers with XLA and the calls into them, with their JVP rules;
- `dispatch`: when a product goes to the kernel, and XLA's fallback where it does not.

Nothing here knows the model: `s3d_jax.ops` is the one module the model calls.
"""
