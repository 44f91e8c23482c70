"""JAX's persistent compilation cache: where `enable` puts it, that `s3d_jax.load` turns it on, and
the setting that leaves it off."""

import jax

import s3d_jax
from s3d_jax import compile_cache


def test_compile_cache_enable_sets_the_persistent_cache(tmp_path, monkeypatch):
    before = {name: getattr(jax.config, name) for name in ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs")}
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("S3D_JAX_CACHE", str(tmp_path / "root"))
        assert compile_cache.directory() == tmp_path / "root" / "xla"
        assert compile_cache.enable() == tmp_path / "root" / "xla"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "root" / "xla")
        assert jax.config.jax_persistent_cache_min_compile_time_secs <= compile_cache.MIN_COMPILE_SECONDS
        assert (tmp_path / "root" / "xla").is_dir()
        # A directory set beforehand (JAX_COMPILATION_CACHE_DIR) is kept.
        jax.config.update("jax_compilation_cache_dir", str(tmp_path / "mine"))
        assert compile_cache.enable() == tmp_path / "mine"
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "mine")
    finally:
        for name, value in before.items():
            jax.config.update(name, value)


def test_load_turns_the_compile_cache_on_unless_switched_off(tiny_model_dir, tmp_path, monkeypatch):
    before = jax.config.jax_compilation_cache_dir
    try:
        jax.config.update("jax_compilation_cache_dir", None)
        monkeypatch.setenv("S3D_JAX_CACHE", str(tmp_path / "root"))
        monkeypatch.setenv(compile_cache.ENV_SWITCH, "0")
        s3d_jax.load(tiny_model_dir)
        assert jax.config.jax_compilation_cache_dir is None and not (tmp_path / "root" / "xla").exists()
        monkeypatch.delenv(compile_cache.ENV_SWITCH)
        s3d_jax.load(tiny_model_dir)
        assert jax.config.jax_compilation_cache_dir == str(tmp_path / "root" / "xla")
    finally:
        jax.config.update("jax_compilation_cache_dir", before)
