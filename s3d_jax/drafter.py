"""A drafter: what S3D training learns, as one small file applied to its base model at load time
(docs/design.md, "The drafter file").

    <name>.safetensors
      mask_row            [D]       the trained `<M>` embedding
      lora/<path>/{a,b}             draft-only LoRA adapters of the draft layers, one per (fused) projection
      vocab_ranking       [R] int32 the tokens by frequency in the training targets, most frequent first
      metadata (JSON)     format, skip, gamma, lora_rank, draft_vocab_size, tree (the default node budget, 0: the
                          chain), base model identity, tokenizer hash, and optionally the acceptance profile:
                          what trees of each size accepted at each position of held-out replies, from
                          which `decode` chooses its drafting policy (`s3d_jax.predict --profile`)

The verifier never reads the mask row (the mask token is never produced) nor the adapters (only draft
passes apply them), so a model with a drafter applied verifies exactly as the bare base model: S3D's
greedy output is the base model's greedy output. A 7B model's drafter is adapters, not a copy of it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import traverse_util
from safetensors import SafetensorError, safe_open

from s3d_jax import compile_cache, quant
from s3d_jax.checkpoint import CheckpointError, Model, check_params, save_safetensors
from s3d_jax.config import ModelConfig, validate_skip
from s3d_jax.model import abstract_params, draft_head_table, join_qkv
from s3d_jax.options import check_int

FORMAT = 2  # 1: one adapter per projection, before q, k, v and gate, up were fused (read, and fused, by `load_file`)
SUFFIX = ".safetensors"
# What must agree between a drafter and the model it is applied to.
BASE_FIELDS = ("architecture", "vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mask_token_id")
CHECKSUM_COLUMNS = 1024  # of the vocabulary table, summed: tells apart two models of the same shape
CHECKSUM_RTOL = 1e-3  # loose enough for a bfloat16 copy of the same weights
# The type of the adapters and a float table's reduced draft head once applied: half float32's bytes to
# hold and to read in every draft pass. They only shape drafts, which the verifier checks, so greedy output
# is the base model's at any type (docs/design.md, "The drafter's weights in bfloat16"). Training keeps the
# adapters in float32, and so does the file.
DECODE_DTYPE = "bfloat16"


class DrafterError(CheckpointError):
    """A drafter file that is missing, corrupt, or made for another model."""


@dataclasses.dataclass(frozen=True)
class Drafter:
    skip: tuple[int, int]
    gamma: int
    lora_rank: int
    mask_row: np.ndarray  # [D]
    lora: dict  # flat {param path tuple: array}, the draft layers' adapters
    ranking: np.ndarray | None  # token ids, most frequent first, or None
    draft_vocab_size: int  # the default reduced head (0: the full vocabulary)
    base: dict  # BASE_FIELDS and the checksum
    tokenizer_hash: str | None
    tree: int = 0  # the default token-tree size of S3D decoding (0: the argmax chain)
    profile: dict | None = None  # {tree size: per-reply outcomes} (`speedup.choose_policy`), or None


def base_identity(params, config: ModelConfig) -> dict:
    columns = np.arange(min(CHECKSUM_COLUMNS, config.vocab_size))
    columns = columns[columns != config.mask_token_id]  # the mask row is the drafter's own
    table = np.asarray(jax.jit(quant.columns)(params["embed"], jnp.asarray(columns)), np.float32)  # the same at any precision
    return {**{name: getattr(config, name) for name in BASE_FIELDS}, "checksum": float(np.abs(table).sum(dtype=np.float64))}


def tokenizer_hash(tokenizer) -> str | None:
    if tokenizer is None:
        return None
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()[:16]


def count_ranking(tokens, loss_mask, config: ModelConfig) -> np.ndarray:
    """Every producible token id (not the mask, not padding) by how often it is a training target,
    most frequent first; ties by id. Counted once from the training rows."""
    counts = np.bincount(np.asarray(tokens)[np.asarray(loss_mask, bool)].ravel(), minlength=config.vocab_size)
    producible = np.arange(config.produced_vocab_size)
    producible = producible[producible != config.mask_token_id]
    return producible[np.argsort(-counts[producible], kind="stable")].astype(np.int32)


def with_draft_vocab(params, config: ModelConfig, ranking: np.ndarray | None, size: int):
    """`(params, config)` drafting over the `size` most frequent tokens of `ranking` (0: the full head)."""
    params = {k: v for k, v in params.items() if k not in ("draft_vocab", "draft_head")}
    if not size:
        return params, config.replace(draft_vocab_size=0)
    if ranking is None:
        raise DrafterError(f"a reduced draft head of {size} tokens needs a token ranking, and this drafter has none")
    producible = config.produced_vocab_size
    if size > len(ranking):
        raise DrafterError(f"a reduced draft head of {size} tokens is larger than the {len(ranking)} tokens the ranking holds "
                           f"(the model produces {producible})")
    ids = np.sort(np.asarray(ranking[:size], np.int32))
    if ids[0] < 0 or ids[-1] >= producible or config.mask_token_id in ids or len(np.unique(ids)) != size:
        raise DrafterError("the token ranking holds ids the model never produces (the mask, padding, outside the vocabulary) "
                           "or repeats one: it was made for another model")
    head = params["embed"] if config.tie_embeddings else params["lm_head"]
    table = jax.jit(draft_head_table, static_argnums=2)(head, jnp.asarray(ids), config)
    params = {**params, "draft_vocab": jnp.asarray(ids), "draft_head": table}
    return params, config.replace(draft_vocab_size=size)


def extract(params, config: ModelConfig, skip, gamma: int, ranking=None, draft_vocab_size: int = 0, tokenizer=None,
            tree: int = 0) -> Drafter:
    """The drafter inside trained params: the draft layers' adapters and the mask row."""
    if config.mask_token_id is None:
        raise DrafterError("the model has no mask token row, so it has no drafter")
    if config.draft_lora_rank and tuple(skip) != config.draft_skip:
        raise DrafterError(f"the adapters belong to skip range {list(config.draft_skip)}, not {list(skip)}")
    flat = traverse_util.flatten_dict(jax.device_get(params))
    lora = {(f"layer_{layer}", *k[1:]): np.asarray(v[entry], np.float32)  # the stacks' entries, by the draft layer they belong to
            for k, v in flat.items() if k[0] == "layers" and any("_lora" in p for p in k)
            for entry, layer in enumerate(config.draft_layers(skip))}
    mask_row = np.asarray(flat[("embed",)][:, config.mask_token_id], np.float32)
    ranking = None if ranking is None else np.asarray(ranking, np.int32)
    return Drafter(tuple(skip), int(gamma), config.draft_lora_rank, mask_row, lora, ranking, int(draft_vocab_size),
                   base_identity(params, config), tokenizer_hash(tokenizer), int(tree))


def save(path: str | os.PathLike, drafter: Drafter) -> Path:
    """Writes the drafter file whole or not at all."""
    path = Path(path).absolute()
    if path.suffix != SUFFIX:
        raise DrafterError(f"a drafter file is named *{SUFFIX}, got {path.name}")
    tensors = {"mask_row": drafter.mask_row, **{"lora/" + "/".join(k): v for k, v in drafter.lora.items()}}
    if drafter.ranking is not None:
        tensors["vocab_ranking"] = drafter.ranking
    meta = {"format": FORMAT, "skip": list(drafter.skip), "gamma": drafter.gamma, "lora_rank": drafter.lora_rank,
            "draft_vocab_size": drafter.draft_vocab_size, "tree": drafter.tree, "base": drafter.base,
            "tokenizer": drafter.tokenizer_hash}
    if drafter.profile is not None:
        meta["profile"] = {str(size): [{k: np.asarray(v).tolist() for k, v in reply.items()} for reply in replies]
                           for size, replies in drafter.profile.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    save_safetensors({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp, metadata={"s3d_drafter": json.dumps(meta)})
    os.replace(tmp, path)
    return path


def ship(src: str | os.PathLike, dst: str | os.PathLike) -> Path:
    """A trained drafter file (its profile measured) written as it ships with the package: its adapters
    in `DECODE_DTYPE`, to which `apply` casts them on loading anyway, so the file is half the size and
    decodes the same. Training resumes from the run's own float32 file, not this one."""
    return save(dst, load_file(src, DECODE_DTYPE))


def load_file(path: str | os.PathLike, adapter_dtype=None) -> Drafter:
    """The drafter in a file; its adapters cast to `adapter_dtype` one at a time as they are read, if given."""
    path = Path(path)
    if not path.is_file():
        raise DrafterError(f"no drafter file at {path}")
    cast = (lambda k, v: v.astype(adapter_dtype) if k.startswith("lora/") else v) if adapter_dtype is not None else (lambda k, v: v)
    try:
        with safe_open(str(path), framework="np") as f:
            meta_text = (f.metadata() or {}).get("s3d_drafter")
            tensors = {k: cast(k, f.get_tensor(k)) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as e:
        raise DrafterError(f"{path} is not a readable drafter file: {e}") from None
    if meta_text is None:
        raise DrafterError(f"{path} is a safetensors file but not an s3d_jax drafter (no s3d_drafter metadata)")
    try:
        meta = json.loads(meta_text)
        if meta["format"] not in (1, FORMAT):
            raise DrafterError(f"{path} holds drafter format {meta['format']}, and this s3d_jax reads formats 1 and {FORMAT}")
        lora = {tuple(k.split("/")[1:]): v for k, v in tensors.items() if k.startswith("lora/")}
        if meta["format"] == 1:
            lora = fuse_adapters(lora)
        return Drafter(tuple(meta["skip"]), int(meta["gamma"]), int(meta["lora_rank"]), tensors["mask_row"], lora,
                       tensors.get("vocab_ranking"), int(meta["draft_vocab_size"]), meta["base"], meta["tokenizer"],
                       int(meta.get("tree", 0)), read_profile(meta.get("profile")))  # older files record no tree or profile
    except (KeyError, TypeError, ValueError) as e:
        if isinstance(e, DrafterError):
            raise
        raise DrafterError(f"{path} is not a valid drafter file: {type(e).__name__}: {e}") from None


# Format 1's adapters, by the fused projection that now holds them (`model`).
_FUSED_ADAPTERS = {("attn", "qkv_lora"): ("q_lora", "k_lora", "v_lora"), ("mlp", "gate_up_lora"): ("gate_lora", "up_lora")}


def fuse_adapters(lora: dict) -> dict:
    """Format 1's separate adapters as the fused projections' (`adapters.DraftLoRA`): the parts' A factors
    side by side, and their B factors one per output slot (q's `[r, H, E]` as G slots `[r, K, E]`)."""
    separate = {part for parts in _FUSED_ADAPTERS.values() for part in parts}
    out = {k: v for k, v in lora.items() if k[2] not in separate}
    for layer in sorted({k[0] for k in lora}):
        for (module, fused), parts in _FUSED_ADAPTERS.items():
            a = [lora[(layer, module, part, "a")] for part in parts]
            b = [lora[(layer, module, part, "b")] for part in parts]
            if fused == "qkv_lora":  # [r, H, E], [r, K, E] x2 -> [G + 2, r, K, E]
                slots = join_qkv(*b, num_kv_heads=b[1].shape[1], axis=0)
            else:  # [r, F] x2 -> [2, r, F]
                slots = np.stack(b)
            out[(layer, module, fused, "a")] = np.concatenate(a, axis=-1)
            out[(layer, module, fused, "b")] = np.ascontiguousarray(slots)
    return out


def read_profile(stored) -> dict | None:
    """The acceptance profile as `speedup.replay` reads it: {tree size: [{name: array}]}."""
    if stored is None:
        return None
    return {int(size): [{k: np.asarray(v) for k, v in reply.items()} for reply in replies] for size, replies in stored.items()}


def check_base(drafter: Drafter, model: Model, where: str) -> None:
    """Refuses a drafter made for another model or another tokenizer, naming what differs."""
    config = model.config
    for name in BASE_FIELDS:
        if drafter.base.get(name) != getattr(config, name):
            raise DrafterError(f"the drafter {where} was made for another model: its {name} is {drafter.base.get(name)!r}, "
                               f"the model's is {getattr(config, name)!r}")
    checksum = base_identity(model.params, config)["checksum"]
    if not np.isclose(checksum, drafter.base["checksum"], rtol=CHECKSUM_RTOL):
        raise DrafterError(f"the drafter {where} was made for another model of the same shape: the vocabulary table's checksum is "
                           f"{checksum:.6g}, the drafter's base had {drafter.base['checksum']:.6g}")
    ours = tokenizer_hash(model.tokenizer)
    if drafter.tokenizer_hash and ours and ours != drafter.tokenizer_hash:
        raise DrafterError(f"the drafter {where} was made for another tokenizer (vocabulary hash {drafter.tokenizer_hash}, "
                           f"the model's {ours}); its token ranking would name other tokens")


def adapter_stacks(drafter: Drafter, config: ModelConfig, where: str) -> dict:
    """The drafter's adapters as `config`'s stacks, `{param path: [draft layers, ...]}`, in the type of
    `config`'s adapters, one stack at a time; an adapter the file lacks is zero. `config` has the
    drafter's skip range and rank."""
    if not drafter.lora_rank:
        return {}
    stacks = {k: v for k, v in traverse_util.flatten_dict(abstract_params(config.replace(draft_vocab_size=0))).items()
              if any("_lora" in p for p in k)}  # shapes only: no second model in memory
    skip = list(drafter.skip)
    layers = [f"layer_{layer}" for layer in config.draft_layers(drafter.skip)]
    for k, v in drafter.lora.items():  # ("layer_22", "attn", "qkv_lora", "a"): entry 7 of ("layers", "attn", ...) for skip [7, 21]
        stack = stacks.get(("layers", *k[1:]))
        if k[0] not in layers:
            raise DrafterError(f"the drafter {where} has an adapter {'/'.join(k)} outside its draft layers (skip range {skip})")
        if stack is None or stack.shape[1:] != v.shape:
            raise DrafterError(f"the drafter {where} has an adapter {'/'.join(k)} of shape {v.shape} that the model does not "
                               f"(expected {None if stack is None else stack.shape[1:]})")
    out = {}
    for key, stack in stacks.items():
        entries = [drafter.lora.get((layer, *key[1:])) for layer in layers]
        zero = np.zeros(stack.shape[1:], stack.dtype)
        out[key] = jax.device_put(np.stack([zero if e is None else e.astype(stack.dtype) for e in entries]))
    return out


def continue_from(model: Model, path: str | os.PathLike, gamma: int) -> tuple[dict, np.ndarray | None]:
    """(params, ranking) for training that starts where the drafter at `path` stopped: the trainable
    `model` (float32 adapters of the same skip range and rank) with the file's adapters and mask row,
    and the file's token ranking, so that the reduced head drafts the same tokens. Refuses a drafter
    of another base model, skip range, rank or gamma, naming which."""
    where = str(path)
    drafter = load_file(path)
    check_base(drafter, model, where)
    config = model.config
    for name, ours, theirs in (("skip range", list(config.draft_skip or ()), list(drafter.skip)),
                               ("LoRA rank", config.draft_lora_rank, drafter.lora_rank), ("gamma", gamma, drafter.gamma)):
        if ours != theirs:
            raise DrafterError(f"the drafter {where} has {name} {theirs}, and this training run {ours}: set the config to match it")
    flat = traverse_util.flatten_dict(model.params, is_leaf=lambda _, node: quant.is_quantized(node))
    flat.update(adapter_stacks(drafter, config, where))
    params = traverse_util.unflatten_dict(flat)
    embed = jax.jit(quant.set_column, static_argnums=1)(params["embed"], config.mask_token_id, jnp.asarray(drafter.mask_row, jnp.float32))
    return {**params, "embed": embed}, drafter.ranking


@compile_cache.keeping_every_compile()  # its few computations run at every load: a warm process compiles nothing
def apply(model: Model, drafter: Drafter | str | os.PathLike, draft_vocab_size: int | None = None, reuse_base: bool = False) -> Model:
    """The model with the drafter's adapters (in `DECODE_DTYPE`), mask row, defaults and (optionally
    reduced) draft head. `draft_vocab_size` overrides the drafter's default (0: the full head).
    `reuse_base`: the base's vocabulary table takes the mask row in place, once nothing else can fail,
    and `model` is spent: for a caller that drops it (`s3d_jax.load`), since a copy of the table would
    be the largest memory S3D adds at load."""
    where = "given"
    if not isinstance(drafter, Drafter):
        where = str(drafter)
        drafter = load_file(drafter, DECODE_DTYPE)
    check_base(drafter, model, where)
    config = model.config
    skip = validate_skip(drafter.skip, config.num_layers)
    config = config.replace(draft_skip=skip, draft_gamma=drafter.gamma, draft_lora_rank=drafter.lora_rank, draft_tree=drafter.tree,
                            draft_dtype=DECODE_DTYPE)
    if drafter.mask_row.shape != (config.hidden_size,):
        raise DrafterError(f"the drafter {where} has a mask row of shape {drafter.mask_row.shape}, the model needs ({config.hidden_size},)")
    flat = traverse_util.flatten_dict(model.params)  # a draft head applied before is replaced by `with_draft_vocab`
    flat = {k: v for k, v in flat.items() if not any("_lora" in p for p in k)}  # and adapters applied before, here
    flat.update(adapter_stacks(drafter, config, where))
    size = drafter.draft_vocab_size if draft_vocab_size is None else check_int("draft_vocab_size", draft_vocab_size, 0)
    params, config = with_draft_vocab(traverse_util.unflatten_dict(flat), config, drafter.ranking, size)  # the mask is not drafted
    check_params(params, config)
    embed = jax.jit(quant.set_column, static_argnums=1, donate_argnums=0 if reuse_base else ())(
        params["embed"], config.mask_token_id, drafter.mask_row)
    return Model({**params, "embed": embed}, config, model.tokenizer, drafter.profile)
