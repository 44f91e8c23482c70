"""Tree drafting: the tree, its attention mask, acceptance, cache compaction and exact decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import numpy_logits, tiny_model

import s3d_jax
from s3d_jax import api, decoding, sampling, tree
from s3d_jax.cache import KVCache, cached_forward, prompt_forward


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


def _cache_after(model, prefix, max_len=48):
    config = model.config
    cache = KVCache.zeros(config, 1, max_len)
    _, cache = cached_forward(model.params, config, cache, jnp.asarray([prefix]), config.all_layers, True)
    return cache.replace(lengths=jnp.asarray([len(prefix)]))


def _paths(nodes: tree.Tree, b=0):
    """Each node's root-to-node token path (root excluded)."""
    tokens, parents = np.asarray(nodes.tokens)[b], np.asarray(nodes.parents)[b]
    out = []
    for i in range(len(tokens)):
        path, node = [], i
        while node:
            path.append(int(tokens[node]))
            node = int(parents[node])
        out.append(path[::-1])
    return out


@pytest.mark.parametrize("size,gamma", [(1, 3), (6, 2), (16, 4), (40, 5)])
def test_tree_is_the_best_paths_and_closed_under_parents(size, gamma):
    logits = jax.random.normal(jax.random.key(size), (2, gamma, 60)) * 2
    logits = logits.at[..., 59].set(-jnp.inf)  # a never-produced token (the mask)
    nodes = tree.build(jnp.asarray([3, 4]), logits, size)
    depths, parents = np.asarray(nodes.depths), np.asarray(nodes.parents)
    assert nodes.tokens.shape == (2, size + 1)
    assert np.all(np.diff(depths, axis=1) >= 0), "depth-major order"
    assert np.all(depths[:, 1:] == np.take_along_axis(depths, parents, axis=1)[:, 1:] + 1), "a parent is one level up"
    assert np.all(parents[:, 1:] < np.arange(1, size + 1)), "parents come first"
    assert 59 not in np.asarray(nodes.tokens)[:, 1:]
    # The chosen paths are the `size` best of every path up to depth gamma (brute force over the top tokens).
    logp = np.asarray(jax.nn.log_softmax(logits, -1))[0]
    chosen = {tuple(p) for p in _paths(nodes)[1:]}
    scores = sorted((sum(logp[d, t] for d, t in enumerate(p)) for p in chosen), reverse=True)
    best_outside = -np.inf
    frontier = [((), 0.0)]
    for d in range(gamma):
        frontier = [(p + (t,), s + logp[d, t]) for p, s in frontier for t in np.argsort(-logp[d])[:size]]
        frontier = sorted(frontier, key=lambda x: -x[1])[: size * 4]
        best_outside = max([best_outside] + [s for p, s in frontier if p not in chosen])
    assert best_outside <= scores[-1] + 1e-5


@pytest.mark.parametrize("size", [5, 12])
def test_every_node_sees_exactly_its_path(model, size):
    """Each node's verifier logits equal a plain recompute of prefix + root-to-node path."""
    config = model.config
    prefix = np.random.default_rng(size).integers(0, 95, 7).tolist()
    cache = _cache_after(model, prefix)
    draft_logits = jax.random.normal(jax.random.key(size), (1, 4, config.vocab_size)).at[..., config.mask_token_id].set(-jnp.inf)
    nodes = tree.build(jnp.asarray([11]), draft_logits, size)
    logits, _ = tree.verify(model.params, config, cache, nodes, 4)
    for i, path in enumerate(_paths(nodes)):
        reference = numpy_logits(model, prefix + [11] + path)[-1]
        np.testing.assert_allclose(np.asarray(logits)[0, i, : config.mask_token_id], reference[: config.mask_token_id], atol=1e-4,
                                   err_msg=f"node {i}, path {path}")


def test_accepting_the_greedy_path_compacts_the_cache(model):
    """A tree holding the plain greedy continuation (not as the first choice) accepts all of it, and
    the compacted cache equals the cache of plain decoding of the same tokens."""
    config, gamma = model.config, 4
    prefix = np.random.default_rng(3).integers(0, 95, 6).tolist()
    x_n = 21
    greedy = s3d_jax.decode(model, prefix + [x_n], method="ar", max_new_tokens=gamma + 1, eos_token_ids=()).tokens
    # Draft distributions whose second choice at each depth is the greedy token.
    rng = np.random.default_rng(0)
    draft = rng.normal(0, 1, (1, gamma, config.vocab_size)).astype(np.float32)
    for d in range(gamma):
        decoy = (greedy[d] + 1) % 90
        draft[0, d, greedy[d]], draft[0, d, decoy] = 8.0, 9.0
    draft[..., config.mask_token_id] = -np.inf
    nodes = tree.build(jnp.asarray([x_n]), jnp.asarray(draft), 30)  # every mix of the two choices
    cache = _cache_after(model, prefix)
    logits, cache = tree.verify(model.params, config, cache, nodes, gamma)
    k, emitted, path = tree.accept(jax.random.key(0), nodes, logits, gamma, sampling.Sampling())
    assert int(k[0]) == gamma
    assert np.asarray(emitted)[0].tolist() == greedy[: gamma + 1]
    cache = tree.compact(cache, path, k)
    kept = len(prefix) + 1 + gamma
    _, reference = prompt_forward(model.params, config, jnp.asarray([prefix + [x_n] + greedy[:gamma]]), 48)
    for got, want in zip(cache.keys + cache.values, reference.keys + reference.values):
        slots = (slice(None), slice(None), slice(0, kept)) if got.shape[2] == 48 else (Ellipsis, slice(0, kept))
        np.testing.assert_allclose(np.asarray(got)[slots], np.asarray(want)[slots], atol=1e-5)


@pytest.mark.parametrize("size,gamma,skip", [(1, 2, (2, 3)), (3, 3, (1, 4)), (8, 4, (2, 3)), (16, 3, (3, 3)), (33, 5, (0, 2))])
def test_tree_decoding_equals_plain_greedy(model, size, gamma, skip):
    prompts = [np.random.default_rng(s).integers(0, 95, n).tolist() for s, n in ((0, 4), (1, 9), (2, 2))]
    for eos in ((), (7, 30)):
        plain = s3d_jax.decode(model, prompts, method="ar", max_new_tokens=20, eos_token_ids=eos)
        out = s3d_jax.decode(model, prompts, gamma=gamma, skip=skip, tree=size, max_new_tokens=20, eos_token_ids=eos)
        assert out.tokens == plain.tokens, f"eos {eos}"


def test_tree_accepts_at_least_what_the_chain_does():
    """The chain is one path of any tree whose first choices come first: the tree never accepts fewer in total."""
    model = tiny_model(seed=5)
    prompt = [1, 2, 3, 4, 5, 6]
    chain = s3d_jax.decode(model, prompt, gamma=3, skip=(3, 3), max_new_tokens=40, eos_token_ids=())
    wide = s3d_jax.decode(model, prompt, gamma=3, skip=(3, 3), tree=24, max_new_tokens=40, eos_token_ids=())
    assert wide.tokens == chain.tokens
    assert wide.stats.tokens_per_iteration >= chain.stats.tokens_per_iteration


def test_one_compile_per_tree_size(model):
    def compiles(prompt, tree):
        before = decoding.compile_count()
        s3d_jax.decode(model, prompt, tree=tree, gamma=3, skip=(2, 3), max_new_tokens=6, eos_token_ids=())
        return decoding.compile_count() - before

    assert compiles([1, 2, 3], 8) in (1, 2), "the loop, and the prefill unless an earlier decode of this bucket built it"
    assert compiles([4, 5, 6, 7], 8) == 0, "another prompt of the same bucket compiles nothing"
    assert compiles([4, 5, 6, 7], 9) == 1, "a new size compiles the loop again (N is a static shape); the prefill is shared"


@pytest.mark.parametrize("options,match", [
    (dict(tree=-1), "tree must be >= 0"),
    (dict(tree=2.0), "tree must be an int"),
    (dict(tree=4, method="ar"), "needs method 's3d'"),
    (dict(tree=4, method="selfspec"), "needs method 's3d'"),
    (dict(tree=200), "more nodes than the 95 tokens"),
    (dict(tree=60, max_len=64), "tree 60"),
])
def test_bad_tree_requests(model, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        s3d_jax.decode(model, [1, 2, 3], max_new_tokens=4, **options)


def test_top_k_of_any_rank_equals_lax_top_k():
    x = jax.random.normal(jax.random.key(0), (2, 3, 50))
    values, indices = sampling.top_k(x, 5)
    want_values, want_indices = jax.lax.top_k(x, 5)
    np.testing.assert_array_equal(values, want_values)
    np.testing.assert_array_equal(indices, want_indices)


# ---------------------------------------------------------------- the drafter's default tree


def test_a_drafter_default_tree_is_used_for_greedy_s3d_only(model):
    drafted = s3d_jax.Model(model.params, model.config.replace(draft_skip=(2, 3), draft_gamma=3, draft_tree=6))

    def plan(**options):
        return api.prepare(drafted, [1, 2, 3], max_new_tokens=4, **options)[1].plan

    assert plan().tree == 6
    assert plan(tree=0).tree == 0 and plan(tree=9).tree == 9, "an explicit size wins; 0 is the chain"
    assert plan(temperature=0.7).tree == 0, "the default tree is for greedy S3D; sampling drafts the chain"
    assert plan(temperature=0.7, tree=5).tree == 5, "an explicit tree samples too"
    assert plan(method="selfspec").tree == 0 and plan(method="ar").tree == 0
    out = s3d_jax.decode(drafted, [1, 2, 3], max_new_tokens=12, eos_token_ids=())
    assert out.stats.tree == 6 and "s3d (tree 6):" in out.stats.summary()
    assert out.tokens == s3d_jax.decode(drafted, [1, 2, 3], max_new_tokens=12, eos_token_ids=(), method="ar").tokens
