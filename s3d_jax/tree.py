"""Tree drafting from the single S3D draft pass (docs/design.md, "Tree drafting").

One draft pass gives a distribution at each depth 1..γ. Instead of the argmax chain, a token tree of
a static N nodes is verified:
  build    the N best root-to-node paths by the sum of draft log-probabilities along the path
           (depth-by-depth beam of N, then the global best N; ties go to the shallower node, so every
           chosen node's parent is chosen too), nodes ordered depth-major
  graft    a branch copied from the row's own context (prompt lookup) as a root-to-node path: the
           tokens that followed the latest earlier occurrence of the context's last 1-3 tokens (where
           they run into x_n, the copy goes on copying itself, as a text in a loop would). When the
           context supplies all γ of them, the decode loop verifies the branch alone on a bare `root`,
           through all N+γ slots, instead of drafting (`decoding.tree_iteration`). Where a tree already
           holds the branch's first tokens the branch follows those nodes, and a slot the branch does
           not need is dead (never accepted)
  verify   `[x_n, node_1 .. node_N]` in one full-model pass: node i at position n + depth(i), seeing
           the cache and its ancestors only; their keys and values go to slots n .. n+N
  accept   the verifier picks one token at every node: its argmax (greedy), or an independent sample
           of its distribution (sampling); a node is accepted when its token is its parent's pick and
           its parent is accepted, and the deepest accepted node's pick is emitted after the path.
           Siblings hold distinct tokens, so at most one child matches: each emitted token is a sample
           of the verifier's distribution given the tokens before it, which makes sampling lossless.
  along_path  the block's keys and values, every layer's stacked, in the accepted path's order (x_n's, then
           path[0], ...), which the decode loop writes at slot n: the cache stays contiguous with one
           write, no move after

Shapes are static: N, γ and the batch fix every array. All of it runs inside the decode loop.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from s3d_jax.cache import KVCache, block_forward
from s3d_jax.config import ModelConfig
from s3d_jax.model import head_logits
from s3d_jax.ops import ordered_after
from s3d_jax.sampling import Sampling, choose, top_k


@flax.struct.dataclass
class Tree:
    """A batch of token trees, the root (x_n) at index 0 and nodes in depth-major order."""

    tokens: jax.Array  # [B, N+1]
    parents: jax.Array  # [B, N+1] index of each node's parent (the root's is itself)
    depths: jax.Array  # [B, N+1] 0 for the root
    live: jax.Array  # [B, N+1] bool: False for a grafted slot that holds no node


def build(x_n_B, draft_logits_BGV, size: int) -> Tree:
    """The `size` most probable paths of the draft distributions `[B, γ, V]` as a tree under `x_n`."""
    B, G, _ = draft_logits_BGV.shape
    logp, tokens = top_k(jax.nn.log_softmax(draft_logits_BGV.astype(jnp.float32), axis=-1), size)  # [B, G, N]
    scores, parent_slots, level_tokens = [logp[:, 0]], [jnp.zeros((B, size), jnp.int32)], [tokens[:, 0]]
    for d in range(1, G):  # the best `size` extensions of the previous depth's best `size` paths
        candidates = (scores[-1][:, :, None] + logp[:, d][:, None, :]).reshape(B, size * size)
        best, flat = jax.lax.top_k(candidates, size)
        scores.append(best)
        parent_slots.append(flat // size)
        level_tokens.append(jnp.take_along_axis(tokens[:, d], flat % size, axis=1))
    # Global best `size` over every depth's list; id = depth * size + slot breaks ties shallow-first.
    all_scores = jnp.concatenate(scores, axis=1)  # [B, G * N]
    ids = jnp.broadcast_to(jnp.arange(G * size), all_scores.shape)
    chosen = jnp.sort(jnp.lexsort((ids, -all_scores), axis=-1)[:, :size], axis=-1)  # depth-major
    depth0 = chosen // size
    node_tokens = jnp.take_along_axis(jnp.concatenate(level_tokens, axis=1), chosen, axis=1)
    parent_id = (depth0 - 1) * size + jnp.take_along_axis(jnp.concatenate(parent_slots, axis=1), chosen, axis=1)
    parent_index = jax.vmap(jnp.searchsorted)(chosen, parent_id) + 1  # its place among the chosen, after the root
    parents = jnp.where(depth0 == 0, 0, parent_index)
    return Tree(
        tokens=jnp.concatenate([x_n_B[:, None], node_tokens], axis=1).astype(jnp.int32),
        parents=jnp.concatenate([jnp.zeros((B, 1), jnp.int32), parents.astype(jnp.int32)], axis=1),
        depths=jnp.concatenate([jnp.zeros((B, 1), jnp.int32), depth0.astype(jnp.int32) + 1], axis=1),
        live=jnp.ones((B, size + 1), bool),
    )


def root(x_n_B) -> Tree:
    """A tree of the root alone, for a branch to be grafted onto."""
    zeros = jnp.zeros((x_n_B.shape[0], 1), jnp.int32)
    return Tree(tokens=x_n_B[:, None].astype(jnp.int32), parents=zeros, depths=zeros, live=jnp.ones(zeros.shape, bool))


def context_branch(tokens_BL, n_B, length: int, max_ngram: int = 3):
    """`(branch [B, length], known [B, length], matched [B])`: in each row's tokens `[0, n]` (x_n at n),
    the latest earlier occurrence of the longest suffix of up to `max_ngram` tokens, and the tokens after
    it, continued past x_n by copying the copy itself. `known` is False for a row whose last token never
    occurred before (all of its branch) and True otherwise; `matched` is the suffix's length (0: none)."""
    B, L = tokens_BL.shape
    ends = jnp.arange(L)[None, :]
    matches = ends < n_B[:, None]  # an occurrence ends at p < n
    best_end = jnp.full((B,), -1, jnp.int32)
    matched = jnp.zeros((B,), jnp.int32)
    for i in range(max_ngram):  # after step i: the occurrences of the last i+1 tokens
        suffix_token = jnp.take_along_axis(tokens_BL, jnp.maximum(n_B - i, 0)[:, None], axis=1)
        earlier = jnp.pad(tokens_BL, ((0, 0), (i, 0)), constant_values=-1)[:, :L]  # earlier[p] = tokens[p - i]
        matches = matches & (earlier == suffix_token) & (n_B >= i)[:, None]
        latest = jnp.max(jnp.where(matches, ends, -1), axis=1)
        best_end = jnp.where(latest >= 0, latest, best_end)  # a longer match wins
        matched = jnp.where(latest >= 0, i + 1, matched)
    # The copy runs on into itself: past x_n it repeats the `period` tokens after the match, the
    # guess that a text in a loop stays in it (docs/experiments.md, "The branch copies into itself").
    period = jnp.maximum(n_B - best_end, 1)[:, None]
    at = best_end[:, None] + 1 + jnp.arange(length)[None, :] % period
    branch = jnp.take_along_axis(tokens_BL, jnp.clip(at, 0, L - 1), axis=1)
    return branch, jnp.broadcast_to(best_end[:, None] >= 0, at.shape), matched


# A one-token match is a weak guess: decoding skips the draft only on a match of at least two tokens
# (docs/experiments.md, "The branch alone": E rose on every suite at the same speed).
BRANCH_ALONE_MIN_MATCH = 2


def branch_suffices(known_BG, matched_B, done_B) -> jax.Array:
    """Whether to verify the context branch alone this iteration: every active row knows all of its
    branch, copied after a match of at least `BRANCH_ALONE_MIN_MATCH` tokens."""
    return jnp.all((known_BG[:, -1] & (matched_B >= BRANCH_ALONE_MIN_MATCH)) | done_B)


def graft(tree: Tree, branch_BG, known_BG) -> Tree:
    """The tree with `G` more slots holding `branch` as a root-to-node path. The branch follows the
    tree's own nodes while their tokens agree, so siblings stay distinct; the slots it does not need
    (tokens already in the tree, or not known) are dead."""
    B, T = tree.tokens.shape
    is_node = jnp.arange(T)[None, :] > 0
    at = jnp.zeros((B,), jnp.int32)  # the branch's last node so far (the root to start)
    in_tree = jnp.ones((B,), bool)
    tokens, parents, live = [], [], []
    for d in range(branch_BG.shape[1]):
        token = branch_BG[:, d]
        child = is_node & (tree.parents == at[:, None]) & (tree.tokens == token[:, None])  # at most one
        found = in_tree & jnp.any(child, axis=1)
        new = known_BG[:, d] & ~found
        tokens.append(token)
        parents.append(at)
        live.append(new)
        at = jnp.where(found, jnp.argmax(child, axis=1), jnp.where(new, T + d, at)).astype(jnp.int32)
        in_tree = found
    G = branch_BG.shape[1]
    return Tree(
        tokens=jnp.concatenate([tree.tokens, jnp.stack(tokens, axis=1).astype(jnp.int32)], axis=1),
        parents=jnp.concatenate([tree.parents, jnp.stack(parents, axis=1)], axis=1),
        depths=jnp.concatenate([tree.depths, jnp.broadcast_to(jnp.arange(1, G + 1, dtype=jnp.int32), (B, G))], axis=1),
        live=jnp.concatenate([tree.live, jnp.stack(live, axis=1)], axis=1),
    )


def ancestor_mask(tree: Tree, max_depth: int):
    """`[B, N+1, N+1]`: node i sees node j when j is i or one of its ancestors."""
    n = tree.tokens.shape[1]
    seen = jnp.eye(n, dtype=bool)[None]
    current = jnp.broadcast_to(jnp.arange(n), tree.parents.shape)
    for _ in range(max_depth):
        current = jnp.take_along_axis(tree.parents, current, axis=1)
        seen = seen | jax.nn.one_hot(current, n, dtype=bool)
    return seen


def verify_block(params, config: ModelConfig, cache: KVCache, tree: Tree, max_depth: int):
    """Full-model logits `[B, N+1, V]` at every node, each seeing the cache and its own ancestors, and
    the nodes' keys and values for slots `n .. n+N`, ordered after every read of the cache
    (`ops.ordered_after`); the cache itself is only read."""
    positions = cache.lengths[:, None] + tree.depths
    hidden, block_kvs = block_forward(params, config, cache, tree.tokens, config.all_layers,
                                      positions_BT=positions, block_mask_BTT=ancestor_mask(tree, max_depth))
    return head_logits(params, config, hidden), ordered_after(hidden, block_kvs)


def verify(params, config: ModelConfig, cache: KVCache, tree: Tree, max_depth: int):
    """`verify_block`, with the nodes' keys and values written to slots `n .. n+N`: `(logits, cache)`."""
    logits, block_kvs = verify_block(params, config, cache, tree, max_depth)
    return logits, cache.write(config.all_layers, block_kvs)


def accept(rng, tree: Tree, target_logits_BTV, max_depth: int, sampling: Sampling):
    """`(k [B], emitted [B, γ+1], path [B, γ])`. `emitted[:, :k]` are the accepted path's tokens,
    `emitted[:, k]` the verifier's token after it, `path[:, :k]` the accepted nodes."""
    target = choose(rng, target_logits_BTV, sampling)  # [B, N+1]: the verifier's pick at every node
    correct = (tree.tokens == jnp.take_along_axis(target, tree.parents, axis=1)) & tree.live
    correct = correct.at[:, 0].set(True)
    accepted = correct
    for _ in range(max_depth):  # accepted: correct, and so is every ancestor
        accepted = correct & jnp.take_along_axis(accepted, tree.parents, axis=1)
    best = jnp.argmax(jnp.where(accepted, tree.depths, -1), axis=1)  # the deepest; among those, the most probable
    k = jnp.take_along_axis(tree.depths, best[:, None], axis=1)[:, 0]
    path = jnp.zeros((tree.tokens.shape[0], max_depth), jnp.int32)
    node = best
    for _ in range(max_depth):  # walk up from the best node, recording each node at its depth
        depth = jnp.take_along_axis(tree.depths, node[:, None], axis=1)[:, 0]
        path = jnp.where((jnp.arange(max_depth)[None, :] == depth[:, None] - 1), node[:, None], path)
        node = jnp.take_along_axis(tree.parents, node[:, None], axis=1)[:, 0]
    j = jnp.arange(max_depth + 1)[None, :]
    path_tokens = jnp.take_along_axis(tree.tokens, path, axis=1)
    bonus = jnp.take_along_axis(target, best[:, None], axis=1)
    emitted = jnp.where(j < k[:, None], jnp.pad(path_tokens, ((0, 0), (0, 1))), bonus)
    return k, emitted, path


def along_path(block_kv, path_BG):
    """The block's keys `[L, B, K, T, E]` and values `[L, B, K, E, T]` taken in the order of the accepted
    path, `[x_n, path[0], .. path[G-1]]`: G+1 slots, of which those past k hold stale entries (masked,
    as any past n + k). Written at slot n, slot n + j then holds the path's j-th token, as plain
    decoding would have written it."""
    order = jnp.concatenate([jnp.zeros_like(path_BG[:, :1]), path_BG], axis=1)  # [B, G+1]

    def take(x, axis):
        shape = [1] * x.ndim
        shape[1], shape[axis] = order.shape
        return jnp.take_along_axis(x, order.reshape(shape), axis=axis, mode="clip")

    keys, values = block_kv
    return take(keys, 3), take(values, 4)
