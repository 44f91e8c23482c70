"""The drafter file and the reduced draft head: round trip, exactness against the bare model, bad files."""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import traverse_util
from reference import assert_exact, tiny_model
from safetensors import safe_open

import s3d_jax
from s3d_jax import Model, drafter
from s3d_jax.cache import KVCache, cached_forward
from s3d_jax.drafter import DrafterError
from s3d_jax.model import NEG_INF, draft_head_logits, head_logits, init_normal
from s3d_jax.speculative import Plan, draft_s3d

SKIP, GAMMA, RANK = (2, 3), 3, 4


def _trained(seed=0, rank=RANK):
    """A tiny base model and the same model with non-zero adapters and a moved mask row, as training leaves it."""
    base = tiny_model(seed=seed)
    with_lora = tiny_model(seed=seed, draft_lora_rank=rank, draft_skip=SKIP)
    rng = np.random.default_rng(seed)

    def perturb(path, x):
        name = jax.tree_util.keystr(path)
        if "_lora" in name:
            return jnp.asarray(rng.normal(0, 0.3, x.shape), x.dtype)
        if name == "['embed']":
            return x.at[:, base.config.mask_token_id].set(jnp.asarray(rng.normal(0, 1, x.shape[0]), x.dtype))
        return x

    params = jax.tree_util.tree_map_with_path(perturb, with_lora.params)
    return base, Model(params, with_lora.config)


def _ranking(config, seed=1):
    return np.random.default_rng(seed).permutation(config.mask_token_id).astype(np.int32)  # every id but the mask (the last)


def _file(tmp_path, ranking=True, draft_vocab_size=0, seed=0, name="d.safetensors"):
    base, trained = _trained(seed)
    rank = _ranking(base.config) if ranking else None
    d = drafter.extract(trained.params, trained.config, SKIP, GAMMA, rank, draft_vocab_size)
    return base, trained, drafter.save(tmp_path / name, d)


def test_round_trip_restores_adapters_mask_row_and_defaults(tmp_path):
    base, trained, path = _file(tmp_path, draft_vocab_size=40)
    assert path.stat().st_size < 200_000
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask, "readable like any other new file, not owner-only"
    loaded = drafter.load_file(path)
    assert loaded.skip == SKIP and loaded.gamma == GAMMA and loaded.lora_rank == RANK and loaded.draft_vocab_size == 40
    np.testing.assert_array_equal(loaded.ranking, _ranking(base.config))
    applied = drafter.apply(base, path)
    assert (applied.config.draft_skip, applied.config.draft_gamma, applied.config.draft_vocab_size) == (SKIP, GAMMA, 40)
    got, want = traverse_util.flatten_dict(applied.params), traverse_util.flatten_dict(trained.params)
    draft_layers = trained.config.draft_layers(SKIP)
    for key, value in want.items():
        if "_lora" in "".join(key):  # a stack of adapters, one per draft layer, rounded to the decode type
            assert got[key].dtype == jnp.dtype(drafter.DECODE_DTYPE) and value.dtype == jnp.float32
            assert got[key].shape[0] == len(draft_layers) < trained.config.num_layers, "the skipped layers have no entries"
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value.astype(drafter.DECODE_DTYPE)), err_msg=str(key))
        else:
            np.testing.assert_array_equal(np.asarray(got[key]), np.asarray(value), err_msg=str(key))
    np.testing.assert_array_equal(np.asarray(applied.params["draft_vocab"]), np.sort(_ranking(base.config)[:40]))


def test_a_shipped_file_holds_the_adapters_as_decoding_reads_them_and_decodes_the_same(tmp_path):
    base, _, path = _file(tmp_path, draft_vocab_size=40)
    shipped = drafter.ship(path, tmp_path / "shipped.safetensors")
    assert shipped.stat().st_size < 0.75 * path.stat().st_size
    with safe_open(str(shipped), framework="np") as f:
        assert {str(f.get_tensor(k).dtype) for k in f.keys() if k.startswith("lora/")} == {drafter.DECODE_DTYPE}
    a, b = drafter.apply(base, path), drafter.apply(base, shipped)
    for x, y in zip(jax.tree.leaves(a.params), jax.tree.leaves(b.params)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    assert (a.config, a.profile) == (b.config, b.profile)


def test_verifier_is_bit_identical_and_decoding_exact(tmp_path):
    base, _, path = _file(tmp_path, draft_vocab_size=32)
    ids = np.random.default_rng(0).integers(0, 95, (2, 12))
    mask_id = base.config.mask_token_id
    for size in (0, 8, 32, 95 - 1):
        model = drafter.apply(base, path, draft_vocab_size=size)
        got, want = np.asarray(s3d_jax.logits(model, ids)), np.asarray(s3d_jax.logits(base, ids))
        assert np.array_equal(np.delete(got, mask_id, -1), np.delete(want, mask_id, -1))
        for prompt, eos in (([5, 9, 2, 7], ()), ([[1, 2, 3], [4, 5, 6]], (3,))):
            assert_exact(model, prompt, plain_model=base, max_new_tokens=14, eos_token_ids=eos)


def test_reduced_head_only_proposes_its_tokens_and_never_the_mask(tmp_path):
    base, _, path = _file(tmp_path)
    model = drafter.apply(base, path, draft_vocab_size=16)
    # The mask row as the best-scoring direction: a full head would propose it if it were not excluded.
    config = model.config
    cache = KVCache.zeros(config, 1, 32)
    _, cache = cached_forward(model.params, config, cache, jnp.asarray([[3, 4, 5]]), config.all_layers, True)
    cache = cache.replace(lengths=jnp.asarray([3]))
    plan = Plan.make(config, "s3d", gamma=6, skip=SKIP)
    drafts, logits, _ = draft_s3d(model.params, config, plan, cache, jnp.asarray([6]), jax.random.key(0))
    allowed = set(np.asarray(model.params["draft_vocab"]).tolist())
    assert set(np.asarray(drafts).ravel().tolist()) <= allowed and config.mask_token_id not in allowed
    assert np.all(np.asarray(logits)[..., config.mask_token_id] == NEG_INF)


def test_reduced_head_also_scores_each_rows_context_exactly(tmp_path):
    """Context ids get the full head's exact logits, per row, and the frequent ids those of its columns
    in the draft head's type; ids neither frequent nor in the row's context (so rows do not mix), and
    the mask id even in a context, stay -inf."""
    base, _, path = _file(tmp_path)
    model = drafter.apply(base, path, draft_vocab_size=16)
    config = model.config
    frequent = set(np.asarray(model.params["draft_vocab"]).tolist())
    rare = [t for t in range(config.vocab_size) if t not in frequent and t != config.mask_token_id][:3]
    context = np.array([[rare[0], rare[1], rare[0], 0], [config.mask_token_id, rare[2], 7, 7]], np.int32)
    hidden = jax.random.normal(jax.random.key(1), (2, 3, config.hidden_size))
    logits = np.asarray(draft_head_logits(model.params, config, hidden, jnp.asarray(context)))
    full = np.asarray(head_logits(model.params, config, hidden))
    head = "embed" if config.tie_embeddings else "lm_head"
    assert model.params["draft_head"].dtype == jnp.dtype(drafter.DECODE_DTYPE)
    rounded = {**model.params, head: model.params[head].astype(drafter.DECODE_DTYPE).astype(jnp.float32)}
    full_rounded = np.asarray(head_logits(rounded, config, hidden))
    for b in range(2):
        scored = sorted((frequent | set(context[b].tolist())) - {config.mask_token_id})
        from_context = sorted(set(context[b].tolist()) - frequent - {config.mask_token_id})
        np.testing.assert_allclose(logits[b][:, from_context], full[b][:, from_context], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(logits[b][:, sorted(frequent)], full_rounded[b][:, sorted(frequent)], rtol=1e-5, atol=1e-5)
        unscored = np.setdiff1d(np.arange(config.vocab_size), scored)
        assert np.all(logits[b][:, unscored] == NEG_INF)


def test_reduced_head_scores_only_the_context_below_each_rows_length(tmp_path):
    """Ids past a row's context length (`context_lengths_B`: padding, stale slots) are not scored."""
    base, _, path = _file(tmp_path)
    model = drafter.apply(base, path, draft_vocab_size=16)
    config = model.config
    frequent = set(np.asarray(model.params["draft_vocab"]).tolist())
    rare = [t for t in range(config.vocab_size) if t not in frequent and t != config.mask_token_id][:4]
    context = jnp.asarray([[rare[0], rare[1], rare[2], rare[3]]] * 2, jnp.int32)
    hidden = jax.random.normal(jax.random.key(1), (2, 3, config.hidden_size))
    logits = np.asarray(draft_head_logits(model.params, config, hidden, context, jnp.asarray([2, 4])))
    everything = np.asarray(draft_head_logits(model.params, config, hidden, context))
    assert np.all(logits[0][:, rare[2:]] == NEG_INF) and np.all(logits[0][:, rare[:2]] > NEG_INF)
    np.testing.assert_array_equal(logits[1], everything[1])


def test_a_drafter_without_a_ranking_falls_back_to_the_full_head(tmp_path):
    base, _, path = _file(tmp_path, ranking=False)
    model = drafter.apply(base, path)
    assert model.config.draft_vocab_size == 0 and "draft_vocab" not in model.params
    assert_exact(model, [1, 2, 3], plain_model=base, max_new_tokens=8, eos_token_ids=())
    with pytest.raises(DrafterError, match="needs a token ranking"):
        drafter.apply(base, path, draft_vocab_size=8)


def test_count_ranking_orders_by_frequency_and_skips_mask_and_padding():
    config = tiny_model().config.replace(output_vocab_size=90)
    tokens = np.array([[7, 7, 7, 3, 3, 95, 92, 1]])
    loss = np.array([[1, 1, 1, 1, 1, 1, 1, 0]], bool)
    ranking = drafter.count_ranking(tokens, loss, config)
    assert ranking[:2].tolist() == [7, 3]
    assert 95 not in ranking and 92 not in ranking and len(ranking) == 90


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("size,match", [(96, "96 tokens is larger than the 95"), (-1, "draft_vocab_size"), (2.5, "draft_vocab_size")])
def test_bad_draft_vocabulary_size(tmp_path, size, match):
    base, _, path = _file(tmp_path)
    with pytest.raises((ValueError, TypeError), match=match):
        drafter.apply(base, path, draft_vocab_size=size)


def test_a_drafter_for_another_model_is_refused(tmp_path):
    _, _, path = _file(tmp_path, seed=0)
    with pytest.raises(DrafterError, match="another model of the same shape"):
        drafter.apply(tiny_model(seed=7), path)
    with pytest.raises(DrafterError, match="hidden_size"):
        drafter.apply(tiny_model(seed=0, hidden_size=24, head_dim=6), path)


@pytest.mark.needs("bundled_model")
def test_a_drafter_for_another_tokenizer_is_refused(tmp_path):
    from s3d_jax import bundled

    base, trained = _trained()
    d = drafter.extract(trained.params, trained.config, SKIP, GAMMA, _ranking(base.config), 8, bundled.tokenizer())
    path = drafter.save(tmp_path / "d.safetensors", d)

    class OtherTokenizer:
        def get_vocab(self):
            return {"a": 0, "b": 1}

    with pytest.raises(DrafterError, match="another tokenizer"):
        drafter.apply(Model(base.params, base.config, OtherTokenizer()), path)


def test_adapters_belong_to_the_layers_outside_their_skip_range(tmp_path):
    """The adapters are stacked over the draft layers alone: drafting over other layers, a file with an
    adapter of a skipped layer, or adapters without a skip range are refused by name."""
    from safetensors.numpy import save_file

    from s3d_jax.config import ConfigError

    base, trained, path = _file(tmp_path)
    applied = drafter.apply(base, path)
    with pytest.raises(ValueError, match=r"outside its skip range \[2, 3\]: it drafts with that range, not \[1, 3\]"):
        s3d_jax.decode(applied, [1, 2, 3], max_new_tokens=4, method="s3d", skip=(1, 3))
    with pytest.raises(DrafterError, match=r"adapters belong to skip range \[2, 3\], not \[1, 2\]"):
        drafter.extract(trained.params, trained.config, (1, 2), GAMMA)
    with pytest.raises(ConfigError, match="draft_lora_rank needs draft_skip"):
        base.config.replace(draft_lora_rank=4)
    with safe_open(str(path), framework="np") as f:
        tensors, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata()
    moved = {k.replace("lora/layer_4/", "lora/layer_2/"): v for k, v in tensors.items()}  # layer 2 is skipped
    save_file(moved, str(tmp_path / "moved.safetensors"), metadata=meta)
    with pytest.raises(DrafterError, match=r"layer_2/.* outside its draft layers \(skip range \[2, 3\]\)"):
        drafter.apply(base, tmp_path / "moved.safetensors")


def test_reusing_the_base_sets_the_mask_row_in_its_table_once_nothing_can_fail(tmp_path):
    """`reuse_base` (what `s3d_jax.load` passes): the same model as a copy would give, the base's table
    spent; a drafter refused leaves the base whole."""
    base, _, path = _file(tmp_path, draft_vocab_size=40)
    copied = drafter.apply(base, path)
    spent = tiny_model(seed=0)
    with pytest.raises(DrafterError, match="larger than"):
        drafter.apply(spent, path, draft_vocab_size=10_000, reuse_base=True)
    assert not spent.params["embed"].is_deleted()
    reused = drafter.apply(spent, path, reuse_base=True)
    assert spent.params["embed"].is_deleted()
    for (key, got), want in zip(traverse_util.flatten_dict(reused.params).items(), traverse_util.flatten_dict(copied.params).values()):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=str(key))


def test_a_ranking_holding_the_mask_id_is_refused():
    base = tiny_model()
    with pytest.raises(DrafterError, match="never produces"):
        drafter.with_draft_vocab(base.params, base.config, np.array([95, 1, 2], np.int32), 3)


@pytest.mark.parametrize("content", [b"", b"not a safetensors file at all", b"\x08\x00\x00\x00\x00\x00\x00\x00{}garbage"])
def test_corrupt_drafter_files(tmp_path, content):
    base = tiny_model()
    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(DrafterError, match="bad.safetensors"):
        drafter.apply(base, path)


def test_truncated_and_foreign_files(tmp_path):
    from safetensors.numpy import save_file

    base, _, path = _file(tmp_path)
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(DrafterError, match="cut.safetensors"):
        drafter.apply(base, cut)
    foreign = tmp_path / "foreign.safetensors"
    save_file({"x": np.zeros(3, np.float32)}, str(foreign))
    with pytest.raises(DrafterError, match="not an s3d_jax drafter"):
        drafter.apply(base, foreign)
    with pytest.raises(DrafterError, match="no drafter file"):
        drafter.apply(base, tmp_path / "missing.safetensors")


def test_load_refuses_bad_drafter_arguments(tmp_path):
    with pytest.raises(TypeError, match="drafter must be a path"):
        s3d_jax.load(drafter=3)
    with pytest.raises(ValueError, match="needs a drafter"):
        s3d_jax.load(drafter=None, draft_vocab_size=8)


def test_the_default_tree_round_trips_and_older_files_have_none(tmp_path):
    import dataclasses
    import json

    from safetensors.numpy import load_file, save_file

    base, _, path = _file(tmp_path)
    drafter.save(path, dataclasses.replace(drafter.load_file(path), tree=16))
    assert drafter.load_file(path).tree == 16 and drafter.apply(base, path).config.draft_tree == 16
    # A file written before drafters recorded a tree: no "tree" in its metadata.
    from safetensors import safe_open
    with safe_open(str(path), framework="np") as f:
        meta = json.loads(f.metadata()["s3d_drafter"])
    del meta["tree"]
    save_file(load_file(str(path)), str(path), metadata={"s3d_drafter": json.dumps(meta)})
    assert drafter.load_file(path).tree == 0 and drafter.apply(base, path).config.draft_tree == 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_loading_in_another_dtype_casts_while_reading(tmp_path, dtype):
    """`load(dtype=...)` casts the stored float32 leaves while reading them: bit for bit what casting
    after loading gives, and the draft vocabulary's ids stay integers."""
    from s3d_jax import checkpoint
    from s3d_jax.quant import cast_params

    base = tiny_model()
    ranking = np.array([i for i in range(base.config.produced_vocab_size) if i != base.config.mask_token_id])
    params, config = drafter.with_draft_vocab(base.params, base.config, ranking, 16)
    checkpoint.save(tmp_path / "model", params, config)
    loaded = checkpoint.load(tmp_path / "model", dtype)
    assert loaded.config.dtype == dtype and loaded.params["draft_vocab"].dtype == jnp.int32
    expected = cast_params(checkpoint.load(tmp_path / "model").params, jnp.dtype(dtype))
    for got, want in zip(jax.tree.leaves(loaded.params), jax.tree.leaves(expected), strict=True):
        assert got.dtype == want.dtype and bool((got == want).all())


def test_a_format_1_file_s_separate_adapters_load_fused_with_the_same_products(tmp_path):
    """Format 1 held an adapter per projection; loaded, q, k, v's and gate, up's become their fused
    projection's, and each part of the fused update is what its own adapter made."""
    import json

    from safetensors.numpy import save_file

    from s3d_jax.adapters import DraftLoRA

    base, _, _ = _file(tmp_path)
    c = base.config
    D, H, K, E, F, r = c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim, c.intermediate_size, RANK
    G = H // K
    rng = np.random.default_rng(0)
    shapes = {"q": (H, E), "k": (K, E), "v": (K, E), "gate": (F,), "up": (F,)}
    separate = {(name, f): rng.normal(size=(D, r) if f == "a" else (r, *shape)).astype(np.float32)
                for name, shape in shapes.items() for f in "ab"}
    old = {"mask_row": np.zeros(D, np.float32)}
    for (name, f), w in separate.items():
        old[f"lora/layer_0/{'attn' if name in ('q', 'k', 'v') else 'mlp'}/{name}_lora/{f}"] = w
    meta = {"format": 1, "skip": list(SKIP), "gamma": GAMMA, "lora_rank": r, "draft_vocab_size": 0,
            "base": drafter.base_identity(base.params, c), "tokenizer": None}
    save_file(old, str(tmp_path / "old.safetensors"), metadata={"s3d_drafter": json.dumps(meta)})
    lora = drafter.load_file(tmp_path / "old.safetensors").lora
    x = rng.normal(size=(2, D)).astype(np.float32)
    part = {name: np.einsum("td,dr,r...->t...", x, separate[(name, "a")], separate[(name, "b")]) for name in shapes}

    def fused(name, out_shape, slot_parts, slot_axis):
        module = DraftLoRA(r, 1, (D,), out_shape, jnp.float32, "highest", init_normal, slot_parts, slot_axis)  # a stack of one
        params = {f: lora[("layer_0", "attn" if name == "qkv" else "mlp", f"{name}_lora", f)][None] for f in "ab"}
        projection = jnp.zeros((1, D, *out_shape), jnp.float32)  # the update alone is compared
        return np.asarray(module.apply({"params": params}, x, 0, 0, projection)[1])

    qkv = fused("qkv", (K, G + 2, E), (0,) * G + (1, 2), 1)  # each KV head's query heads, then its key and value
    np.testing.assert_allclose(qkv[:, :, :G].reshape(2, H, E), part["q"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(qkv[:, :, G], part["k"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(qkv[:, :, G + 1], part["v"], rtol=1e-5, atol=1e-5)
    gate_up = fused("gate_up", (2, F), (0, 1), 0)
    np.testing.assert_allclose(gate_up[:, 0], part["gate"], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(gate_up[:, 1], part["up"], rtol=1e-5, atol=1e-5)
    assert drafter.apply(base, tmp_path / "old.safetensors").config.draft_lora_rank == r
