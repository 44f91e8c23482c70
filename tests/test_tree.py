"""Tree drafting: the tree, its attention mask, acceptance, the accepted path written in order and exact decoding."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_exact, forward, numpy_logits, tiny_model

import s3d_jax
from s3d_jax import api, decoding, planning, sampling, speculative, tree
from s3d_jax.cache import KVCache, prompt_forward
from s3d_jax.kernel import ffi


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


# The passes the tests run one by one, jitted as decoding runs them: one compile per shape instead of one per operation.
build_tree = jax.jit(tree.build, static_argnums=2)
verify_tree = jax.jit(tree.verify, static_argnums=(1, 4))
verify_tree_block = jax.jit(tree.verify_block, static_argnums=(1, 4))


def _cache_after(model, prefix, max_len=48):
    config = model.config
    cache = KVCache.zeros(config, 1, max_len)
    _, cache = forward(model.params, config, cache, jnp.asarray([prefix]), config.all_layers, True)
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
    nodes = build_tree(jnp.asarray([3, 4]), logits, size)
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


def _verified_tree(model, size):
    """A tree of `size` nodes of random drafts under root 11 after a random prefix of 7, verified:
    (prefix, the cache after it, the tree, the nodes' verifier logits)."""
    config = model.config
    prefix = np.random.default_rng(size).integers(0, 95, 7).tolist()
    cache = _cache_after(model, prefix)
    draft_logits = jax.random.normal(jax.random.key(size), (1, 4, config.vocab_size)).at[..., config.mask_token_id].set(-jnp.inf)
    nodes = build_tree(jnp.asarray([11]), draft_logits, size)
    return prefix, cache, nodes, verify_tree(model.params, config, cache, nodes, 4)[0]


@pytest.mark.parametrize("size", [5, 12])
def test_every_node_sees_exactly_its_path(model, size):
    """Each node's verifier logits equal a plain recompute of prefix + root-to-node path."""
    config = model.config
    prefix, _, nodes, logits = _verified_tree(model, size)
    for i, path in enumerate(_paths(nodes)):
        reference = numpy_logits(model, prefix + [11] + path)[-1]
        np.testing.assert_allclose(np.asarray(logits)[0, i, : config.mask_token_id], reference[: config.mask_token_id], atol=1e-4,
                                   err_msg=f"node {i}, path {path}")


@pytest.mark.skipif(not ffi.available(), reason="the few-row kernel's attention is what orders the sums alike")
@pytest.mark.parametrize("size", [5, 12])
def test_every_node_s_logits_equal_plain_steps_bit_for_bit(size):
    """A node's verifier logits are those of one-token steps over its root-to-node path, to the last bit:
    its ancestors in the block are summed where the steps find them, in the cache (kernel/cc/attention.cc,
    `Ancestors`). Rounded activations (int8, 16-bit) then keep S3D exact. Heads of 32: the kernel's attention."""
    model = tiny_model(seed=1, hidden_size=64, intermediate_size=96, num_heads=2, num_kv_heads=1, head_dim=32)
    config = model.config
    _, cache, nodes, logits = _verified_tree(model, size)
    step = jax.jit(lambda cache, token: speculative.verify(model.params, config, cache, token, jnp.zeros((1, 0), jnp.int32)))
    for i, path in enumerate(_paths(nodes)):
        stepped = cache
        for token in [11, *path]:
            step_logits, stepped = step(stepped, jnp.asarray([token]))
            stepped = stepped.replace(lengths=stepped.lengths + 1)
        np.testing.assert_array_equal(np.asarray(logits)[0, i], np.asarray(step_logits)[0, 0], err_msg=f"node {i}, path {path}")


def test_the_greedy_path_written_in_its_order_is_plain_decoding_s_cache(model):
    """A tree holding the plain greedy continuation (not as the first choice) accepts all of it, and
    its keys and values, written in the path's order, equal the cache of plain decoding of the same tokens."""
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
    nodes = build_tree(jnp.asarray([x_n]), jnp.asarray(draft), 30)  # every mix of the two choices
    cache = _cache_after(model, prefix)
    logits, block_kvs = verify_tree_block(model.params, config, cache, nodes, gamma)
    k, emitted, path = tree.accept(jax.random.key(0), nodes, logits, gamma, sampling.Sampling())
    assert int(k[0]) == gamma
    assert np.asarray(emitted)[0].tolist() == greedy[: gamma + 1]
    cache = cache.write(config.all_layers, tree.along_path(block_kvs, path))
    kept = len(prefix) + 1 + gamma
    _, reference = prompt_forward(model.params, config, jnp.asarray([prefix + [x_n] + greedy[:gamma]]), 48)
    np.testing.assert_allclose(np.asarray(cache.keys)[:, :, :, :kept], np.asarray(reference.keys)[:, :, :, :kept], atol=1e-5)
    np.testing.assert_allclose(np.asarray(cache.values)[..., :kept], np.asarray(reference.values)[..., :kept], atol=1e-5)


@pytest.mark.parametrize("size,gamma,skip", [(1, 2, (2, 3)), (3, 3, (1, 4)), (8, 4, (2, 3)), (16, 3, (3, 3)), (33, 5, (0, 2))])
def test_tree_decoding_equals_plain_greedy(model, size, gamma, skip):
    prompts = [np.random.default_rng(s).integers(0, 95, n).tolist() for s, n in ((0, 4), (1, 9), (2, 2))]
    for eos in ((), (7, 30)):
        assert_exact(model, prompts, gamma=gamma, skip=skip, tree=size, min_certainty=0.0, max_new_tokens=20, eos_token_ids=eos)


def test_tree_accepts_at_least_what_the_chain_does():
    """The chain is one path of any tree whose first choices come first: the tree never accepts fewer in total."""
    model = tiny_model(seed=5)
    prompt = [1, 2, 3, 4, 5, 6]
    chain = s3d_jax.decode(model, prompt, gamma=3, skip=(3, 3), max_new_tokens=40, eos_token_ids=())
    wide = s3d_jax.decode(model, prompt, gamma=3, skip=(3, 3), tree=24, min_certainty=0.0, max_new_tokens=40, eos_token_ids=())
    assert wide.tokens == chain.tokens
    assert wide.stats.tokens_per_iteration >= chain.stats.tokens_per_iteration


def test_one_compile_per_tree_size(model):
    def compiles(prompt, tree, lookup):
        before = decoding.compile_count()
        s3d_jax.decode(model, prompt, tree=tree, lookup=lookup, gamma=3, skip=(2, 3), max_new_tokens=6, eos_token_ids=())
        return decoding.compile_count() - before

    assert compiles([1, 2, 3], 8, False) in (1, 2), "the loop, and the prefill unless an earlier decode of this bucket built it"
    assert compiles([4, 5, 6, 7], 8, False) == 0, "another prompt of the same bucket compiles nothing"
    assert compiles([4, 5, 6, 7], 9, False) == 1, "a new size compiles the loop again (N is a static shape); the prefill is shared"
    assert compiles([4, 5, 6, 7], 9, True) == 2, "with the context branch the reach is N+γ: the prefill's histogram too"
    assert compiles([1, 2, 3], 9, True) == 0


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


def test_a_drafter_default_tree_is_used_for_s3d_greedy_or_sampled(model):
    drafted = s3d_jax.Model(model.params, model.config.replace(draft_skip=(2, 3), draft_gamma=3, draft_tree=6))

    def plan(**options):
        return api.prepare(drafted, [1, 2, 3], max_new_tokens=4, **options)[1].plan

    assert plan().tree == 6
    assert plan(tree=0).tree == 0 and plan(tree=9).tree == 9, "an explicit size wins; 0 is the chain"
    assert plan(temperature=0.7).tree == 6, "sampling drafts the tree too (accepted where a sample matches a node)"
    assert plan(temperature=0.7, tree=5).tree == 5, "an explicit tree samples too"
    assert plan(method="selfspec").tree == 0 and plan(method="ar").tree == 0
    out = s3d_jax.decode(drafted, [1, 2, 3], max_new_tokens=12, eos_token_ids=())
    assert out.stats.tree == 6 and "s3d, tree of 6 + context branch:" in out.stats.summary()
    assert out.tokens == s3d_jax.decode(drafted, [1, 2, 3], max_new_tokens=12, eos_token_ids=(), method="ar").tokens


# ---------------------------------------------------------------- the branch copied from the context


def _reference_branch(tokens, n, length, max_ngram=3):
    """Plain Python: the `length` tokens after the latest earlier occurrence of the longest suffix of
    tokens[:n+1], copying on past x_n; that suffix's length; and where the occurrence ends."""
    context = tokens[: n + 1]
    for m in range(min(max_ngram, n + 1), 0, -1):
        for end in range(n - 1, m - 2, -1):
            if context[end - m + 1 : end + 1] == context[n - m + 1 : n + 1]:
                copied = list(context)
                for j in range(length):  # copying on past x_n copies what was just copied
                    copied.append(copied[end + 1 + j])
                return copied[n + 1 :], m, end
    return [], 0, None


def test_context_branch_is_the_latest_longest_match():
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 4, (64, 24))  # a small vocabulary: matches of every length occur
    n = rng.integers(0, 24, 64)
    branch, known, matched = map(np.asarray, tree.context_branch(jnp.asarray(tokens, jnp.int32), jnp.asarray(n, jnp.int32), 5))
    copies_itself = 0
    for b in range(64):
        want, length, end = _reference_branch(tokens[b].tolist(), int(n[b]), 5)
        assert known[b].sum() == len(want) and np.all(known[b][: len(want)]), f"row {b}: all or nothing"
        assert branch[b][: len(want)].tolist() == want, f"row {b}"
        assert matched[b] == length, f"row {b}"
        copies_itself += end is not None and end + 5 > n[b]
    assert set(matched.tolist()) == {0, 1, 2, 3}, "no match, and matches of every length, all occur"
    assert copies_itself, "some branch runs into x_n and copies itself"


def test_the_branch_alone_needs_every_active_row_to_know_it_after_a_long_enough_match():
    known = jnp.asarray([[True, True], [True, True], [True, False]])

    def suffices(matched, done):
        return bool(tree.branch_suffices(known, jnp.asarray(matched), jnp.asarray(done)))

    assert suffices([3, 2, 3], [False, False, True]), "the third row is done: its branch does not count"
    assert not suffices([3, 2, 3], [False, False, False]), "the third row knows only part of its branch"
    assert not suffices([3, 1, 3], [False, False, True]), "a one-token match is too weak a guess"
    assert suffices([tree.BRANCH_ALONE_MIN_MATCH] * 3, [False, False, True])


def _random_tree(rng, size, gamma, vocab=24, batch=6):
    logits = jnp.asarray(rng.normal(0, 2, (batch, gamma, vocab)), jnp.float32)
    return build_tree(jnp.asarray(rng.integers(0, vocab, batch), jnp.int32), logits, size)


@pytest.mark.parametrize("size,gamma", [(1, 2), (6, 3), (20, 4)])
def test_graft_adds_the_branch_as_a_path_and_keeps_siblings_distinct(size, gamma):
    rng = np.random.default_rng(size)
    nodes = _random_tree(rng, size, gamma)
    branch = rng.integers(0, 24, (6, gamma))
    branch[:, 0] = np.asarray(nodes.tokens)[:, 1]  # half the rows start inside the tree
    branch[::2] = rng.integers(0, 24, (3, gamma))
    known = np.arange(gamma)[None, :] < rng.integers(0, gamma + 1, (6, 1))
    grafted = tree.graft(nodes, jnp.asarray(branch, jnp.int32), jnp.asarray(known))
    assert grafted.tokens.shape == (6, size + 1 + gamma)
    live = np.asarray(grafted.live)
    assert live[:, : size + 1].all(), "the draft's own nodes stay"
    tokens, parents = np.asarray(grafted.tokens), np.asarray(grafted.parents)
    depths = np.asarray(grafted.depths)
    for b in range(6):
        paths = _paths(grafted, b)
        live_paths = [tuple(p) for i, p in enumerate(paths) if live[b, i]]
        assert len(live_paths) == len(set(live_paths)), "two live nodes with one path: siblings repeat a token"
        assert all(depths[b, i] == len(paths[i]) for i in range(len(paths)) if live[b, i])
        assert all(live[b, parents[b, i]] for i in range(len(paths)) if live[b, i]), "a live node's parent is live"
        want = tuple(branch[b][: known[b].sum()].tolist())
        assert all(want[:d] in live_paths for d in range(1, len(want) + 1)), "every prefix of the known branch is a node"
        assert len(live_paths) == len(set(live_paths) | {want[:d] for d in range(1, len(want) + 1)}), "no more than it needs"
    assert np.all(tokens[:, : size + 1] == np.asarray(nodes.tokens))


def test_a_dead_slot_is_never_accepted():
    """A slot the branch did not need holds a token the verifier may well pick; it still never counts."""
    nodes = tree.Tree(tokens=jnp.asarray([[5, 1, 2]]), parents=jnp.asarray([[0, 0, 1]]), depths=jnp.asarray([[0, 1, 2]]),
                      live=jnp.asarray([[True, True, False]]))
    logits = jax.nn.one_hot(jnp.asarray([[1, 2, 3]]), 8) * 10  # the verifier picks 1 at the root and 2 after node 1
    k, emitted, _ = tree.accept(jax.random.key(0), nodes, logits, 2, sampling.Sampling())
    assert int(k[0]) == 1, "without the live flag node 2 would match the verifier's pick after node 1"
    assert np.asarray(emitted)[0, :2].tolist() == [1, 2]


@pytest.mark.parametrize("size", [3, 9])
def test_every_grafted_node_sees_exactly_its_path(model, size):
    config = model.config
    prefix = [7, 8, 9, 10, 7, 8]
    cache = _cache_after(model, prefix)
    draft_logits = jax.random.normal(jax.random.key(size), (1, 4, config.vocab_size)).at[..., config.mask_token_id].set(-jnp.inf)
    tokens = jnp.zeros((1, 48), jnp.int32).at[0, : len(prefix) + 1].set(jnp.asarray(prefix + [9]))
    nodes = tree.graft(build_tree(jnp.asarray([9]), draft_logits, size), *tree.context_branch(tokens, jnp.asarray([len(prefix)]), 4)[:2])
    live_paths = [p for i, p in enumerate(_paths(nodes)) if np.asarray(nodes.live)[0, i]]
    assert [10, 7, 8, 9] in live_paths, "7 8 9 occurred before, followed by 10 7 8 9"
    logits, _ = verify_tree(model.params, config, cache, nodes, 4)
    for i, path in enumerate(_paths(nodes)):
        if np.asarray(nodes.live)[0, i]:
            reference = numpy_logits(model, prefix + [9] + path)[-1]
            np.testing.assert_allclose(np.asarray(logits)[0, i, : config.mask_token_id], reference[: config.mask_token_id],
                                       atol=1e-4, err_msg=f"node {i}, path {path}")


@pytest.mark.parametrize("size,gamma", [(1, 2), (6, 4)])
def test_lookup_decoding_equals_plain_greedy_and_accepts_more_on_repeats(model, size, gamma):
    """A prompt that repeats itself: the branch copies the repeat. The output stays plain greedy's."""
    prompts = [[3, 14, 15, 92, 65, 35] * 4, np.random.default_rng(1).integers(0, 95, 9).tolist(), [8, 8]]
    options = dict(gamma=gamma, skip=(2, 3), tree=size, min_certainty=0.0, max_new_tokens=24, eos_token_ids=())
    with_branch, plain = assert_exact(model, prompts, lookup=True, **options)
    without, _ = assert_exact(model, prompts, plain=plain, lookup=False, **options)
    assert with_branch.stats.tokens_per_iteration > without.stats.tokens_per_iteration
    assert with_branch.stats.lookup and not without.stats.lookup


def test_a_context_that_supplies_the_whole_branch_skips_the_draft(model):
    """Where every active row's context gives all γ branch tokens, the iteration verifies the branch
    alone (no draft pass); the output is still plain greedy's."""
    prompt = [3, 14, 15, 92, 65, 35] * 5
    options = dict(gamma=3, skip=(2, 3), tree=4, min_certainty=0.0, max_new_tokens=24, eos_token_ids=())
    with_branch, plain = assert_exact(model, prompt, lookup=True, **options)
    without, _ = assert_exact(model, prompt, plain=plain, lookup=False, **options)
    assert 0 < sum(with_branch.stats.branch_only) <= sum(with_branch.stats.iterations)
    assert sum(without.stats.branch_only) == 0
    assert "the context branch alone" in with_branch.stats.summary()


def test_the_branch_alone_accepts_more_than_gamma_from_a_long_copy(model):
    """The branch alone runs on past γ through all N+γ slots, so one pass can accept more than γ
    tokens where the context holds a long enough copy; the output is still plain greedy's. (This
    prompt sends the tiny model's greedy reply into a cycle of 3 tokens, which the branch copies.)"""
    seed = np.random.default_rng(3).integers(0, 95, 6).tolist()
    reply = s3d_jax.decode(model, seed, method="ar", max_new_tokens=40, eos_token_ids=()).tokens
    prompt = seed + reply + seed
    out, _ = assert_exact(model, prompt, gamma=2, skip=(2, 3), tree=4, lookup=True, min_certainty=0.0, max_new_tokens=32, eos_token_ids=())
    histogram = np.sum(out.stats.accept_histogram, axis=0)
    assert len(histogram) == 4 + 2 + 1, "k = 0..N+γ"
    assert histogram[3:].sum() > 0, f"no iteration accepted more than γ = 2 drafts: {histogram.tolist()}"
    assert len(out.stats.acceptance_per_depth) == 6


@pytest.mark.parametrize("lookup", [False, True])
def test_the_verifier_certainty_is_its_top_probability_where_it_picked_x_n(model, lookup):
    """After the prefill and after every iteration, drafted or not, the state's certainty is the full
    model's top probability at the position that picked x_n (numpy reference)."""
    prompt = [3, 14, 15, 92, 65, 35] * 2
    _, run, _ = api.prepare(model, prompt, gamma=3, skip=(2, 3), tree=4, lookup=lookup, min_certainty=0.0, max_new_tokens=24,
                            eos_token_ids=())
    state = run.start()
    while not bool(state.done[0]):  # a finished row's last token may be a draft cut off by max_new_tokens
        n = int(state.cache.lengths[0])
        logits = numpy_logits(model, np.asarray(state.tokens)[0, :n].tolist())[-1, : model.config.mask_token_id]
        probs = np.exp(logits - logits.max())
        np.testing.assert_allclose(float(state.gate.certainty[0]), probs.max() / probs.sum(), rtol=1e-4)
        state = run.advance(state, int(state.iteration) + 1)
    assert int(state.iteration) > 2 and (int(state.stats.branch_only[0]) > 0) == lookup


@pytest.mark.parametrize("certainty,plain_step", [(0.3, True), (0.7, False)])
def test_an_iteration_drafts_only_where_the_text_is_predictable(model, certainty, plain_step):
    """Below `min_certainty` the iteration is one plain step (one token, counted apart from the accept
    histogram); at or above it the draft pass runs and the tree is verified."""
    _, run, _ = api.prepare(model, [5, 6, 7, 8], gamma=3, skip=(2, 3), tree=4, lookup=False, min_certainty=0.5, max_new_tokens=16,
                            eos_token_ids=())
    state = run.start()
    state = state.replace(gate=state.gate.replace(certainty=jnp.full_like(state.gate.certainty, certainty)))
    after = jax.jit(decoding.iterate, static_argnums=(1, 2))(run.params, run.config, run.plan, state)
    assert int(after.stats.plain_steps[0]) == plain_step
    assert int(after.stats.accept_histogram.sum()) == (not plain_step)
    if plain_step:
        assert int(after.num_generated[0]) == 2, "a plain step emits one token"


def test_plain_steps_keep_decoding_exact_and_are_reported(model):
    """Never drafting (min_certainty 1) is plain decoding through the tree's loop; a threshold between
    the certainties mixes the two kinds. Every output stays plain greedy's."""
    prompts = [np.random.default_rng(s).integers(0, 95, n).tolist() for s, n in ((0, 4), (1, 9))]
    options = dict(gamma=3, skip=(2, 3), tree=4, lookup=False, max_new_tokens=20, eos_token_ids=())
    always, plain = assert_exact(model, prompts, min_certainty=0.0, **options)
    never, _ = assert_exact(model, prompts, plain=plain, min_certainty=1.0, **options)
    assert sum(always.stats.plain_steps) == 0
    assert never.stats.plain_steps == [19, 19] and sum(never.stats.iterations) == 0, "the prefill picks the first token"
    assert "plain steps" in never.stats.summary() and "no draft was verified" in never.stats.summary()
    assert "nan" not in never.stats.summary() + always.stats.summary()
    _, run, _ = api.prepare(model, prompts, min_certainty=0.0, **options)
    gated = []  # per iteration, the certainty a gate must exceed to make it a plain step: its active rows' highest
    state = run.start()
    while not bool(np.all(state.done)):
        gated.append(float(np.max(np.asarray(state.gate.certainty)[~np.asarray(state.done)])))
        state = run.advance(state, int(state.iteration) + 1)
    low, high = sorted(set(gated))[len(set(gated)) // 2 - 1: len(set(gated)) // 2 + 1]
    middle = (low + high) / 2  # some iterations below it, some above
    mixed, _ = assert_exact(model, prompts, plain=plain, min_certainty=middle, **options)
    assert 0 < sum(mixed.stats.plain_steps) and 0 < sum(mixed.stats.iterations)


def test_the_default_min_certainty_is_for_every_tree(model):
    plan = lambda **options: planning.plan_for(model.config, s3d_jax.DecodeOptions(**options))  # noqa: E731
    assert plan(tree=4).min_certainty == s3d_jax.options.DEFAULT_MIN_CERTAINTY
    assert plan(tree=4, temperature=0.7).min_certainty == s3d_jax.options.DEFAULT_MIN_CERTAINTY, "sampled trees are gated too"
    assert plan(tree=4, min_certainty=0.25).min_certainty == 0.25
    assert plan(tree=0).min_certainty == 0.0


@pytest.mark.parametrize("options,match", [
    (dict(min_certainty=1.5, tree=4), r"must be in \[0, 1\]"),
    (dict(min_certainty=float("nan"), tree=4), "must be finite"),
    (dict(min_certainty="high", tree=4), "must be a number"),
    (dict(min_certainty=0.5, tree=0), "give tree=N"),
    (dict(min_certainty=0.5, method="ar"), "needs method 's3d'"),
])
def test_bad_min_certainty_requests(model, options, match):
    with pytest.raises((ValueError, TypeError), match=match):
        s3d_jax.decode(model, [1, 2, 3], max_new_tokens=4, gamma=3, skip=(2, 3), **options)
