"""The cache, the decode loop and speculative decoding on random models (CPU, float32)."""

import dataclasses
import itertools
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from reference import assert_exact, forward, numpy_logits, tiny_model

import s3d_jax
from s3d_jax import api, cpu, decoding
from s3d_jax.cache import KVCache, cached_forward
from s3d_jax.kernel import dispatch, ffi
from s3d_jax.model import lm_logits
from s3d_jax.options import PROMPT_STEP_MIN, PROMPT_STEPS, bucket, prompt_bucket
from s3d_jax.quant import cast_params
from s3d_jax.sampling import Sampling
from s3d_jax.speculative import Plan, draft_s3d


def random_prompts(lengths, vocab=95, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, vocab, n).tolist() for n in lengths]


logits_of = jax.jit(lm_logits, static_argnums=1)  # beside `forward`, for the cache's step-by-step tests


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=1)


# ------------------------------------------------------------------ cache


def test_cached_decoding_equals_recomputation(model):
    """Prefill then one token at a time through the cache gives the logits of a full recompute."""
    tokens = np.asarray(random_prompts([14])[0])
    cache = KVCache.zeros(model.config, 1, 32)
    layers = model.config.all_layers
    hidden, cache = forward(model.params, model.config, cache, jnp.asarray(tokens[None, :6]), layers, True)
    steps = [logits_of(model.params, model.config, hidden)]
    cache = cache.replace(lengths=cache.lengths + 6)
    for t in range(6, len(tokens)):
        hidden, cache = forward(model.params, model.config, cache, jnp.asarray(tokens[None, t : t + 1]), layers, True)
        steps.append(logits_of(model.params, model.config, hidden))
        cache = cache.replace(lengths=cache.lengths + 1)
    cached = np.concatenate([np.asarray(s)[0] for s in steps])
    np.testing.assert_allclose(cached, numpy_logits(model, tokens), atol=1e-4)


def test_batch_rows_do_not_disturb_each_other(model):
    prompts = random_prompts([3, 11, 7], seed=2)
    batch = s3d_jax.decode(model, prompts, method="ar", max_new_tokens=12, eos_token_ids=())
    for prompt, tokens in zip(prompts, batch.tokens):
        alone = s3d_jax.decode(model, prompt, method="ar", max_new_tokens=12, eos_token_ids=())
        assert alone.tokens == tokens


def test_plain_greedy_matches_numpy_reference(model):
    prompt = random_prompts([5], seed=3)[0]
    out = s3d_jax.decode(model, prompt, method="ar", max_new_tokens=10, eos_token_ids=())
    sequence = list(prompt)
    for _ in range(10):
        sequence.append(int(np.argmax(numpy_logits(model, sequence)[-1][: model.config.mask_token_id])))
    assert out.tokens == sequence[len(prompt) :]


# ------------------------------------------------------------------ exactness

EXACTNESS_CASES = [
    # (config overrides, method, gamma, skip, prompt lengths, max_new_tokens)
    (dict(), "s3d", 1, (2, 3), [5], 24),
    (dict(), "s3d", 2, (1, 4), [4, 9], 24),
    (dict(), "s3d", 3, (2, 2), [1, 6, 13], 30),
    (dict(), "s3d", 4, (0, 3), [8], 24),
    (dict(), "s3d", 5, (3, 5), [2, 17], 24),
    (dict(), "s3d", 6, (1, 4), [7, 7, 3, 12], 33),
    (dict(num_kv_heads=4), "s3d", 3, (2, 3), [6, 2], 24),  # MHA
    (dict(tie_embeddings=True, rope_theta=1e5), "s3d", 4, (1, 3), [5, 9], 24),
    (dict(architecture="mistral", sliding_window=6), "s3d", 3, (2, 3), [10, 4], 24),
    (dict(), "selfspec", 1, (2, 3), [5, 8], 24),
    (dict(), "selfspec", 3, (1, 4), [3, 11, 6], 24),
    (dict(), "selfspec", 6, (2, 2), [9], 30),
]


@pytest.mark.parametrize("overrides,method,gamma,skip,lengths,max_new", EXACTNESS_CASES)
def test_greedy_speculative_equals_plain_greedy(overrides, method, gamma, skip, lengths, max_new):
    model = tiny_model(seed=len(lengths) + gamma, **overrides)
    prompts = random_prompts(lengths, seed=gamma)
    spec, plain = assert_exact(model, prompts, method=method, gamma=gamma, skip=skip, max_new_tokens=max_new, eos_token_ids=())
    assert all(len(t) == max_new for t in spec.tokens)
    assert sum(spec.stats.iterations) <= sum(plain.stats.iterations)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_16_bit_weights_compute_as_float32_does(dtype):
    """In passes of a few tokens a bfloat16 or float16 model is the float32 model of its rounded
    weights: float32 activations and cache, and the kernel widens the weights exactly, so the hidden
    states are the same bits. (Rounded to 16 bits, a verify pass's last-bit differences from a step
    would become visible.)"""
    if not dispatch.applies(8, jnp.float32, jnp.dtype(dtype)):
        pytest.skip("the few-row kernel is off: XLA's dot takes the weights' 16-bit inputs")
    model = tiny_model(seed=2)
    narrow = s3d_jax.Model(cast_params(model.params, jnp.dtype(dtype)), model.config.replace(dtype=dtype))
    widened = s3d_jax.Model(cast_params(narrow.params, jnp.float32), model.config)
    tokens = jnp.asarray(random_prompts([4, 4], seed=3))
    hidden = {}
    for name, m in (("narrow", narrow), ("widened", widened)):
        cache = KVCache.zeros(m.config, 2, 16)
        assert all(k.dtype == jnp.float32 for k in cache.keys)
        _, cache = forward(m.params, m.config, cache, tokens, m.config.all_layers, True)
        cache = cache.replace(lengths=cache.lengths + 4)
        hidden[name], _ = forward(m.params, m.config, cache, tokens[:, :2], m.config.all_layers, False)
    assert hidden["narrow"].dtype == jnp.float32
    np.testing.assert_array_equal(hidden["narrow"], hidden["widened"])


@pytest.mark.parametrize("method", ["s3d", "selfspec"])
def test_eos_positions_stop_each_row_like_plain_greedy(model, method):
    prompts = random_prompts([4, 9, 6], seed=5)
    free = s3d_jax.decode(model, prompts, method="ar", max_new_tokens=30, eos_token_ids=())
    # Stop tokens picked so the rows stop at different depths (one row possibly never).
    eos = (free.tokens[0][7], free.tokens[1][2])
    _, plain = assert_exact(model, prompts, method=method, gamma=4, skip=(2, 3), max_new_tokens=30, eos_token_ids=eos)
    assert plain.tokens[0][-1] in eos and len(plain.tokens[0]) <= 8
    assert plain.tokens[1][-1] in eos and len(plain.tokens[1]) <= 3


def test_statistics_are_consistent(model):
    out = s3d_jax.decode(model, random_prompts([6, 3]), method="s3d", gamma=3, skip=(2, 3), max_new_tokens=20, eos_token_ids=())
    stats = out.stats
    hist = np.asarray(stats.accept_histogram)
    assert hist.shape == (2, 4) and hist.sum(axis=1).tolist() == stats.iterations
    # The first token comes from the prefill; every iteration emits k + 1 (capped at the end).
    emitted = (hist * np.arange(1, 5)).sum(axis=1)
    assert np.all(emitted >= np.asarray(stats.generated_tokens) - 1)
    assert 1.0 <= stats.tokens_per_iteration <= 4.0
    assert len(stats.acceptance_per_depth) == 3


# ------------------------------------------------------------------ draft


@pytest.mark.parametrize("gamma,skip", [(1, (2, 3)), (3, (1, 4)), (5, (0, 2))])
def test_draft_pass_equals_plain_recompute(model, gamma, skip):
    """Draft logits at every depth equal a plain recompute of prefix + block through the draft
    layers, with the prefix's keys and values taken from the full model."""
    config = model.config
    prefix = random_prompts([9], seed=gamma)[0]
    x_n = 17
    cache = KVCache.zeros(config, 1, 32)
    _, cache = cached_forward(model.params, config, cache, jnp.asarray([prefix]), config.all_layers, True)
    cache = cache.replace(lengths=jnp.asarray([len(prefix)]))
    plan = Plan.make(config, "s3d", gamma=gamma, skip=skip)
    _, draft_logits, after = draft_s3d(model.params, config, plan, cache, jnp.asarray([x_n]), jax.random.key(0))
    block = [x_n] + [config.mask_token_id] * (gamma - 1)
    reference = numpy_logits(model, prefix + block, layers=config.draft_layers(skip), frozen_prefix=len(prefix))
    got = np.asarray(draft_logits)[0, :, : config.mask_token_id]
    np.testing.assert_allclose(got, reference[len(prefix) :, : config.mask_token_id], atol=1e-4)
    # The draft does not write the cache.
    for before, now in zip(cache.keys, after.keys):
        assert np.array_equal(np.asarray(before), np.asarray(now))


def test_mask_token_is_never_produced():
    model = tiny_model(seed=4)
    # Make the mask row's logit the largest everywhere: it must still never be chosen.
    params = dict(model.params)
    params["lm_head"] = params["lm_head"].at[:, model.config.mask_token_id].set(100.0)
    model = s3d_jax.Model(params, model.config)
    out = s3d_jax.decode(model, [1, 2, 3], method="s3d", gamma=3, skip=(2, 3), max_new_tokens=12, eos_token_ids=())
    assert model.config.mask_token_id not in out.tokens


def test_greedy_argmax_picks_the_first_of_equal_maxima_as_jnp_argmax_does():
    from s3d_jax.sampling import argmax

    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 5, 1000)).astype(np.float32)
    logits[0, :, [7, 900]] = 9.0  # ties: the first wins
    logits[1, 2, :] = -np.inf  # NEG_INF everywhere but one
    logits[1, 2, 500] = 0.0
    logits[2] = np.round(logits[2])  # many ties
    got = np.asarray(jax.jit(argmax)(jnp.asarray(logits)))
    np.testing.assert_array_equal(got, np.argmax(logits, axis=-1))
    assert got.dtype == np.int32 and got[0, 0] == 7


# ------------------------------------------------------------------ sampling


SAMPLING_PROMPT = [1, 3, 2]


@pytest.fixture(scope="module")
def sampling_model():
    """A tiny model of 5 tokens and a mask row with sharply different probabilities, and its last
    logits after the prompt and after every continuation of up to 2 tokens, {continuation: logits}:
    one forward pass per length, shared by every case."""
    model = tiny_model(seed=7, scale=10.0, vocab_size=6, mask_token_id=5)
    tokens = [t for t in range(model.config.vocab_size) if t != model.config.mask_token_id]
    last = {}
    for depth in range(3):
        prefixes = list(itertools.product(tokens, repeat=depth))
        logits = s3d_jax.logits(model, np.asarray([SAMPLING_PROMPT + list(p) for p in prefixes]))[:, -1]
        last.update(zip(prefixes, np.asarray(logits)))
    return model, last


def _target_joint(model, last, sampling, depth=3):
    """Exact distribution of the first `depth` sampled tokens under the target model."""
    from s3d_jax.model import NEG_INF
    from s3d_jax.sampling import log_probs

    prefixes = list(last)
    logits = jnp.asarray(np.stack([last[p] for p in prefixes])).at[:, model.config.mask_token_id].set(NEG_INF)
    probs = dict(zip(prefixes, np.exp(np.asarray(log_probs(logits, sampling), np.float64))))
    joint = {(): 1.0}
    for _ in range(depth):
        joint = {p + (t,): q * probs[p][t] for p, q in joint.items() for t in range(len(probs[p])) if probs[p][t] > 0}
    return joint


@pytest.mark.parametrize(
    "method,sampling,candidates",
    [
        ("s3d", dict(temperature=1.0), None),
        ("s3d", dict(temperature=0.8, top_k=4, top_p=0.9), None),
        ("selfspec", dict(temperature=1.0), None),
        ("s3d", dict(temperature=1.0, tree=4, min_certainty=0.0), None),  # a tree at every iteration
        # Top-p draws among the 4 largest logits where every row's nucleus ends before the 4th, else over the row.
        ("s3d", dict(temperature=0.8, top_k=4, top_p=0.9, tree=3, min_certainty=0.0), 4),
        ("s3d", dict(temperature=1.0, tree=3, lookup=False, min_certainty=0.0), None),
        # The gate: plain steps where the verifier was unsure of x_n.
        ("s3d", dict(temperature=0.7, top_p=0.9, tree=3, min_certainty=0.6), None),
    ],
)
def test_speculative_sampling_is_lossless(monkeypatch, sampling_model, method, sampling, candidates):
    """The first generated tokens follow the target model's distribution (chi-squared, fixed seed),
    for the chain's rejection rule and for a tree's sample-and-match rule, with the context branch
    (the default with a tree) and without."""
    scipy_stats = pytest.importorskip("scipy.stats")
    if candidates:
        monkeypatch.setattr(s3d_jax.sampling, "NUCLEUS_CANDIDATES", candidates)
    model, last = sampling_model
    n = 6000
    # A cache of 16 positions holds the prompt, the 3 tokens and any draft block: the default 128 cost
    # these 6,000 rows a third of their time in attention over empty slots.
    out = s3d_jax.decode(model, [SAMPLING_PROMPT] * n, method=method, gamma=2, skip=(2, 3), max_new_tokens=3, eos_token_ids=(), seed=11,
                         max_len=16, **sampling)
    target = _target_joint(model, last, Sampling(**{k: v for k, v in sampling.items() if k not in ("tree", "lookup", "min_certainty")}))
    counts = {}
    for row in out.tokens:
        counts[tuple(row)] = counts.get(tuple(row), 0) + 1
    assert set(counts) <= set(target), "sampled a sequence the target gives zero probability"
    # Pool rare cells so each expected count is >= 5.
    cells = sorted(target, key=target.get, reverse=True)
    observed, expected, rest_obs, rest_exp = [], [], 0, 0.0
    for cell in cells:
        if target[cell] * n >= 5:
            observed.append(counts.get(cell, 0))
            expected.append(target[cell] * n)
        else:
            rest_obs += counts.get(cell, 0)
            rest_exp += target[cell] * n
    if rest_exp > 0:
        observed.append(rest_obs)
        expected.append(rest_exp)
    p_value = scipy_stats.chisquare(observed, np.asarray(expected) * n / sum(expected)).pvalue
    assert p_value > 1e-3, f"speculative samples differ from the target distribution (p={p_value:.2g})"
    # Drafts were actually accepted, so the test exercised the acceptance rule.
    assert out.stats.tokens_per_iteration > 1.0


def test_prompt_buckets_pad_by_less_than_a_quarter_octave():
    """A prompt pads to at most its power-of-two bucket, and past 128 tokens to within a quarter of
    that octave: the prompt pass costs each padded token as much as a real one."""
    for n in range(1, 5000):
        padded = prompt_bucket(n)
        assert n <= padded <= bucket(n)
        assert padded - n < max(bucket(n) // 8, PROMPT_STEP_MIN)
    assert prompt_bucket(260) == 320 and prompt_bucket(16) == 16
    assert len({prompt_bucket(n) for n in range(257, 513)}) == PROMPT_STEPS


def test_one_compile_per_bucket(model):
    opts = dict(method="s3d", gamma=3, skip=(2, 3), max_new_tokens=16, eos_token_ids=())
    s3d_jax.decode(model, random_prompts([5], seed=1)[0], **opts)
    count = decoding.compile_count()
    out = s3d_jax.decode(model, random_prompts([12], seed=9)[0], **opts)  # same 16-token bucket
    assert decoding.compile_count() == count
    assert out.stats.compile_seconds == 0.0
    # The next prompt bucket compiles a new prefill; the loop state keeps its shape, so the loop is reused.
    free = s3d_jax.decode(model, random_prompts([40], seed=9)[0], **opts).tokens
    assert decoding.compile_count() == count + 1
    # Other EOS ids, up to four, compile nothing (their array has a fixed width) and still end the reply.
    stop, unused = free[3], [t for t in range(90) if t not in free][:2]
    out = s3d_jax.decode(model, random_prompts([40], seed=9)[0], **{**opts, "eos_token_ids": (*unused, stop)})
    assert decoding.compile_count() == count + 1
    assert out.tokens == free[: free.index(stop) + 1]


def _memory_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum(1 for _ in f)


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="counts Linux's memory mappings")
def test_evicted_executables_release_their_code(model, monkeypatch):
    """A long-lived process that compiles loop after loop keeps its memory mappings bounded: each CPU
    executable maps its code, JAX holds a reference to every executable it compiled, and Linux stops a
    process at 65,530 mappings (XLA's compiler crashes there)."""
    monkeypatch.setattr(decoding, "MAX_EXECUTABLES", 2)  # one decode's prefill and loop
    decoding.forget_compiled()  # the first decode evicts nothing
    before = _memory_mappings()
    for gamma in (2, 3, 4):  # a new loop each: the previous ones are evicted
        s3d_jax.decode(model, [4, 5, 6], method="s3d", gamma=gamma, skip=(2, 3), max_new_tokens=4)
        if gamma == 2:
            one_decode = _memory_mappings() - before  # the mappings of one prefill and one loop
    assert one_decode > 20, "the probe sees executables' mappings"
    assert _memory_mappings() - before < 2 * one_decode


def test_stream_yields_prefixes_of_the_result(model):
    options = s3d_jax.DecodeOptions(method="s3d", gamma=2, skip=(2, 3), max_new_tokens=20, eos_token_ids=())
    chunks = list(s3d_jax.stream(model, [4, 5, 6], options, chunk_iterations=2))
    final = chunks[-1]
    assert len(chunks) > 2
    for partial in chunks[:-1]:
        assert final.tokens[: len(partial[0])] == partial[0]


# ------------------------------------------------------------------ bad input (the table: tests/test_bad_input.py)


def test_s3d_needs_a_mask_row():
    model = tiny_model(mask_token_id=None)
    with pytest.raises(ValueError, match="no mask token row"):
        s3d_jax.decode(model, [1, 2], method="s3d")
    assert s3d_jax.decode(model, [1, 2], method="selfspec", max_new_tokens=4).tokens


def test_decode_loop_keeps_few_row_dots_off_ynnpack(model):
    """On a CPU the loop compiles with `cpu.FEW_ROW_OPTIONS`: its dots of a few rows go to XLA's own
    emitter, which measured faster there than YNNPACK's kernels (docs/cpu.md, "Passes on the CPU")."""
    if cpu.few_row_compiler_options() is None:
        pytest.skip("not a CPU, or this jaxlib has no YNNPACK fusions")
    _, run, _ = s3d_jax.api.prepare(model, random_prompts([5])[0], method="s3d", gamma=3, skip=(2, 3), max_new_tokens=8)
    run.compile()
    prefill, loop = run.executables
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), prefill.out_info)
    stop = jax.ShapeDtypeStruct((), jnp.int32)
    default = decoding.advance_jit.lower(run.params, state, stop, config=run.config, plan=run.plan).compile()
    assert "ynn_fusion" in default.as_text()  # what the option changes: the default does use YNNPACK
    assert "ynn_fusion" not in loop.as_text()
    # A batch whose plain steps hold more rows than the kernel takes keeps the default: there YNNPACK is
    # faster. Its plain loop decides alike, so that both order XLA's own sums the same way.
    _, batched, _ = s3d_jax.api.prepare(model, random_prompts([5] * 9), method="s3d", gamma=3, skip=(2, 3), max_new_tokens=8)
    _, plain, _ = s3d_jax.api.prepare(model, random_prompts([5] * 9), method="ar", max_new_tokens=8)
    assert not batched.few_row_passes and not plain.few_row_passes and run.few_row_passes
    batched.compile()
    assert "ynn_fusion" in batched.executables[1].as_text()


def test_decode_loop_runs_its_projections_in_the_few_row_kernel(model):
    """The loop's passes (1 to γ+1 rows) use the few-row kernel (`s3d_jax/kernel/cc/`), and so does the prompt pass's one-row head;
    a product of more than `dispatch.MAX_ROWS` rows keeps XLA's dot."""
    if not ffi.available():
        pytest.skip("no few-row kernel here (not built, or switched off)")
    _, run, _ = api.prepare(model, random_prompts([20])[0], method="s3d", gamma=3, skip=(2, 3), max_new_tokens=8)
    run.compile()
    prefill, loop = run.executables
    assert ffi.TARGET in loop.as_text()
    assert ffi.TARGET in prefill.as_text()  # the first token's logits: one row
    off = jax.jit(lambda p, t: lm_logits(p, model.config, t)).lower(run.params, jnp.zeros((1, 32, model.config.hidden_size)))
    assert ffi.TARGET not in off.as_text()  # 32 rows: XLA's dot


def test_the_kernel_switch_is_part_of_the_compile_cache_key(model, monkeypatch):
    """Flipping `S3D_JAX_FEW_ROW_KERNEL` in a running process compiles the loop again, without or with
    the kernel, instead of reusing what was compiled under the other setting; the output is the same."""
    if not ffi.available():
        pytest.skip("no few-row kernel here (not built, or switched off)")
    prompt, options = random_prompts([7], seed=4)[0], dict(method="s3d", gamma=3, skip=(2, 3), max_new_tokens=12)

    def loop_text_and_tokens():
        _, run, _ = api.prepare(model, prompt, **options)
        run.compile()
        return run.executables[1].as_text(), s3d_jax.decode(model, prompt, **options).tokens

    with_kernel, tokens = loop_text_and_tokens()
    for off in ("0", "false", "No", "off"):
        monkeypatch.setenv(ffi.ENV_SWITCH, off)
        without_kernel, tokens_off = loop_text_and_tokens()
        assert ffi.TARGET in with_kernel and ffi.TARGET not in without_kernel, off
        assert tokens_off == tokens
    monkeypatch.setenv(ffi.ENV_SWITCH, "1")
    assert ffi.TARGET in loop_text_and_tokens()[0]
    monkeypatch.setenv(ffi.ENV_SWITCH, "maybe")
    with pytest.raises(ValueError, match="S3D_JAX_FEW_ROW_KERNEL='maybe': expected one of"):
        s3d_jax.decode(model, prompt, **options)


def test_the_summary_reports_only_what_was_measured():
    """Depths no draft reached are left out (never `nan`); a run that verified no draft says so."""
    stats = api.DecodeStats(method="s3d", gamma=4, skip=(2, 3), generated_tokens=[20], iterations=[5],
                            accept_histogram=[[2, 2, 1, 0, 0]], decode_seconds=1.0, compile_seconds=2.0, tree=4, lookup=True,
                            branch_only=[1], plain_steps=[6], min_certainty=0.9)
    text = stats.summary()
    assert "nan" not in text and "11 iterations: 4 drafted, 1 the context branch alone, 6 plain steps" in text
    assert "depth 1: 60% of 5, 2: 33% of 3, 3: 0% of 1" in text and "4:" not in text
    never = dataclasses.replace(stats, iterations=[0], accept_histogram=[[0, 0, 0, 0, 0]], branch_only=[0], plain_steps=[19])
    assert "nan" not in never.summary() and "no draft was verified" in never.summary()
    plain = dataclasses.replace(stats, method="ar", gamma=0, tree=0, lookup=False)
    assert plain.summary() == "ar: 20 tokens in 1.00 s, 20.0 tokens/s (compiling took 2.0 s)"


@pytest.mark.parametrize("method,tree,lookup,min_certainty", [("ar", 0, None, None), ("s3d", 0, None, None), ("s3d", 4, False, 0.0),
                                                             ("s3d", 4, True, 0.0), ("s3d", 4, True, 0.5)])
def test_decode_loop_updates_the_cache_in_place(model, method, tree, lookup, min_certainty):
    """No pass copies a layer's cache: each write is ordered after the attention that reads the old
    cache (`ops.ordered_after`), and the tree's three iteration kinds only read it (`decoding.tree_iteration`),
    so XLA updates it in place."""
    _, run, _ = s3d_jax.api.prepare(model, random_prompts([5])[0], method=method, gamma=3, skip=(2, 3), tree=tree,
                                    lookup=lookup, min_certainty=min_certainty, max_new_tokens=8, max_len=256)
    run.compile()
    _, loop = run.executables
    config = model.config
    keys = f"f32[1,{config.num_kv_heads},256,{config.head_dim}]"
    values = f"f32[1,{config.num_kv_heads},{config.head_dim},256]"
    copies = [line for line in loop.as_text().splitlines() if " copy(" in line and (keys in line or values in line)]
    assert not copies, copies[:2]
