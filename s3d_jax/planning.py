"""How a decode request becomes the static plan its loop runs (`plan_for`), and the calibrated drafting
policy that fills what an S3D request left open (`drafting_policy`): one resolution, each field
read top-down in order of precedence, and a line for `DecodeStats.policy` that says what chose it."""

from __future__ import annotations

from s3d_jax import calibration
from s3d_jax.checkpoint import Model
from s3d_jax.config import ModelConfig, validate_skip
from s3d_jax.options import DEFAULT_GAMMA, DEFAULT_MIN_CERTAINTY, DecodeOptions, default_skip
from s3d_jax.sampling import Sampling
from s3d_jax.speculative import Plan
from s3d_jax.speedup import Policy


def drafting_policy(model: Model, options: DecodeOptions, rows: int = 1) -> tuple[Policy | None, str]:
    """The calibrated policy for what S3D left open (tree, lookup and min_certainty all unset, γ the
    drafter's), greedy or sampled, in a batch of `rows`, chosen from the model's pass costs over that many rows
    (`calibration.costs_for`) and its drafter's acceptance profile, and why; (None, "") where the
    request leaves nothing for a policy to choose."""
    open_ = options.tree is None and options.lookup is None and options.min_certainty is None
    drafter_gamma = options.gamma is None or options.gamma == model.config.draft_gamma
    # Sampling too: the profile is greedy acceptance, which a sample matches less often, and each row's
    # gate learns as it decodes where its drafts pay (`Plan.drafted_cost`), sampled or not.
    if not (options.method == "s3d" and open_ and drafter_gamma):
        return None, ""
    policy, source = calibration.drafting_policy(model, rows)
    if policy is None:
        return None, f"the drafter's fixed defaults ({source})"
    return policy, f"{policy.describe()}; {source}"


def first(*values):
    """The first value that is not None: a field's value in order of precedence."""
    return next((v for v in values if v is not None), None)


def plan_for(config: ModelConfig, options: DecodeOptions, policy: Policy | None = None) -> Plan:
    """The static plan a request runs. Each field takes, in this order, the first that is set: the
    request's own value; the calibrated `policy`'s (S3D's open fields, `drafting_policy`),
    which may choose plain steps; the drafter's default (`config.draft_*`); the fixed default."""
    if options.top_k > config.vocab_size:
        raise ValueError(f"top_k {options.top_k} exceeds the vocabulary of {config.vocab_size}")
    sampling = Sampling(options.temperature, options.top_k, options.top_p)
    if options.method == "ar" or (policy is not None and policy.plain):
        return Plan.make(config, "ar", sampling=sampling)
    gamma = first(options.gamma, config.draft_gamma or None, DEFAULT_GAMMA)
    skip = validate_skip(first(options.skip, config.draft_skip, default_skip(config.num_layers)), config.num_layers)
    # A tree's nodes are the draft's likeliest paths, accepted where the verifier's sample matches one
    # (lossless, `tree.accept`): S3D's default at every temperature. Selfspec drafts its chain.
    tree = first(options.tree, policy and policy.tree, config.draft_tree if options.method == "s3d" else 0)
    lookup = first(options.lookup, policy and policy.lookup, bool(tree))
    min_certainty = first(options.min_certainty, policy and policy.min_certainty,
                          DEFAULT_MIN_CERTAINTY if tree else 0.0)
    drafted_cost = policy.drafted_cost if policy is not None else 0.0
    check_plan(config, options, skip, tree)
    return Plan.make(config, options.method, gamma=gamma, skip=skip, sampling=sampling, tree=tree, lookup=lookup,
                     min_certainty=min_certainty, drafted_cost=drafted_cost)


def check_plan(config: ModelConfig, options: DecodeOptions, skip, tree: int) -> None:
    """What a request asks that this model cannot draft (a ValueError naming it)."""
    if config.draft_lora_rank and skip != config.draft_skip:
        raise ValueError(f"this model's draft adapters belong to the layers outside its skip range {list(config.draft_skip)}: "
                         f"it drafts with that range, not {list(skip)}")
    if options.method == "s3d" and config.mask_token_id is None:
        raise ValueError(
            "this checkpoint has no mask token row (mask_token_id is unset): S3D drafting needs one; "
            "convert it again with tools/convert_hf.py"
        )
    draftable = config.draft_vocab_size or config.produced_vocab_size - (config.mask_token_id is not None)
    if tree > draftable:
        raise ValueError(f"tree {tree} has more nodes than the {draftable} tokens the draft can propose at each depth")
    if not tree and (options.lookup or options.min_certainty):
        what = ("lookup verifies a context branch through a token tree's slots" if options.lookup
                else "min_certainty chooses between a drafted token tree and a plain step")
        raise ValueError(f"{what}, and this decode drafts the argmax chain: give tree=N")
