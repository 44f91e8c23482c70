"""llama.cpp's GGUF files (architectures llama, qwen2, qwen3, gemma2, gemma3), read into an `HFSource`:
the metadata becomes an HF-style config, the tensor names HF names, and the weights HF's layout.

What llama.cpp's `convert_hf_to_gguf.py` changed, undone here (transformers' own GGUF loader,
`modeling_gguf_pytorch_utils.py`, undoes the same):
  - llama: q/k rows interleaved for its RoPE layout, put back in rotate-half order. Qwen and
    Gemma use the rotate-half ("NEOX") layout in llama.cpp too, so their rows are unchanged;
  - Gemma: every `*norm.weight` stored as 1 + w: the 1 is taken off again. The embedding is stored
    unscaled, as in transformers, and rows past the tokenizer are cut, so the vocabulary has no padding.
What GGUF metadata may lack, llama.cpp's `llama-model.cpp` fixes per architecture, and so does this
reader: Gemma-2 alternates sliding-window and global layers (the first slides); Gemma-3 has five
sliding layers per global one, and a local RoPE base of 10000; both scale attention scores by
head_dim**-0.5, except the 27B models (46 and 62 layers), which use (hidden / heads)**-0.5.
"""

from __future__ import annotations

import dataclasses
import math
import re
import struct
import warnings
from pathlib import Path

import numpy as np

from s3d_jax import quant
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ConfigError
from s3d_jax.convert.readers import GroupedTensor, HFSource, LazyTensors

MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2", "gemma3": "gemma3_text"}
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
              "gemma2": "Gemma2ForCausalLM", "gemma3": "Gemma3ForCausalLM"}
GGUF_NAMES = {  # GGUF tensor name -> HF tensor name; {i} is the layer.
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
    "blk.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.attn_q.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "blk.{i}.attn_k.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "blk.{i}.attn_v.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "blk.{i}.attn_q.bias": "model.layers.{i}.self_attn.q_proj.bias",
    "blk.{i}.attn_k.bias": "model.layers.{i}.self_attn.k_proj.bias",
    "blk.{i}.attn_v.bias": "model.layers.{i}.self_attn.v_proj.bias",
    "blk.{i}.attn_q_norm.weight": "model.layers.{i}.self_attn.q_norm.weight",
    "blk.{i}.attn_k_norm.weight": "model.layers.{i}.self_attn.k_norm.weight",
    "blk.{i}.attn_output.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "blk.{i}.ffn_gate.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "blk.{i}.ffn_up.weight": "model.layers.{i}.mlp.up_proj.weight",
    "blk.{i}.ffn_down.weight": "model.layers.{i}.mlp.down_proj.weight",
}
GEMMA_NAMES = {  # Gemma's four norms per layer; its ffn_norm is the MLP's input norm.
    **GGUF_NAMES,
    "blk.{i}.post_attention_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "blk.{i}.ffn_norm.weight": "model.layers.{i}.pre_feedforward_layernorm.weight",
    "blk.{i}.post_ffw_norm.weight": "model.layers.{i}.post_feedforward_layernorm.weight",
}


def read_gguf(path: Path, keep_groups: bool = False) -> HFSource:
    """The GGUF at `path`; with `keep_groups`, its tensors of `KEPT_TYPES` as `GroupedTensor`s (no float
    copy), else every tensor dequantized to float32."""
    import gguf  # ~0.25 s to import; only GGUF sources need it

    header = read_header(path)

    def field(key: str, default=None):
        return header.metadata.get(key, default)

    arch = field("general.architecture")
    if arch not in MODEL_TYPES:
        raise ConfigError(f"unsupported GGUF architecture {arch!r} in {path}: supported are {', '.join(MODEL_TYPES)}")
    if field(f"{arch}.expert_count", 0):
        raise ConfigError(f"unsupported GGUF {path}: mixture-of-experts ({arch}.expert_count) is not implemented")
    tokens = field("tokenizer.ggml.tokens")
    names = header.tensors
    if "rope_freqs.weight" in names:
        raise ConfigError(
            f"unsupported GGUF {path}: rope_freqs.weight (Llama-3.1-style RoPE scaling as per-frequency factors) "
            "is not supported; convert the Hugging Face checkpoint instead"
        )
    hidden, heads, layers = field(f"{arch}.embedding_length"), field(f"{arch}.attention.head_count"), field(f"{arch}.block_count")
    head_dim = field(f"{arch}.attention.key_length") or hidden // heads
    kv_heads = field(f"{arch}.attention.head_count_kv") or heads
    gemma = arch.startswith("gemma")
    config = {
        "model_type": MODEL_TYPES[arch],
        "architectures": [HF_CLASSES[arch]],
        "vocab_size": len(tokens) if tokens else field(f"{arch}.vocab_size"),
        "hidden_size": hidden,
        "intermediate_size": field(f"{arch}.feed_forward_length"),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "rope_theta": float(field(f"{arch}.rope.freq_base", 1e6 if arch == "gemma3" else 10000.0)),
        "rms_norm_eps": float(field(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6 if arch != "llama" else 1e-5)),
        "max_position_embeddings": int(field(f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "hidden_act": "silu",
        "bos_token_id": field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": list(
            dict.fromkeys(i for i in (field("tokenizer.ggml.eos_token_id"), field("tokenizer.ggml.eot_token_id")) if i is not None)
        ),
    }
    scaling = field(f"{arch}.rope.scaling.type")
    if scaling not in (None, "none"):
        config["rope_scaling"] = {"rope_type": scaling, "factor": field(f"{arch}.rope.scaling.factor")}
    rope_dim = field(f"{arch}.rope.dimension_count")
    if rope_dim and rope_dim != head_dim:
        config["partial_rotary_factor"] = rope_dim / head_dim
    if gemma:
        big = layers == (46 if arch == "gemma2" else 62)  # the 27B models
        # Newer files may state the layer pattern: a period, or per layer True for a sliding window.
        pattern = field(f"{arch}.attention.sliding_window_pattern", 2 if arch == "gemma2" else 6)
        sliding = list(pattern) if isinstance(pattern, list) else [(i + 1) % pattern != 0 for i in range(layers)]
        config.update(
            hidden_activation="gelu_pytorch_tanh",
            query_pre_attn_scalar=hidden // heads if big else head_dim,
            sliding_window=int(field(f"{arch}.attention.sliding_window", 4096)),
            layer_types=["sliding_attention" if s else "full_attention" for s in sliding],
            attn_logit_softcapping=field(f"{arch}.attn_logit_softcapping", 50.0 if arch == "gemma2" else None),
            final_logit_softcapping=field(f"{arch}.final_logit_softcapping", 30.0 if arch == "gemma2" else None),
        )
        if arch == "gemma3":
            config["rope_local_base_freq"] = float(field(f"{arch}.rope.freq_base_swa", 10000.0))
    for key, value in config.items():
        if value is None and key not in ("bos_token_id", "attn_logit_softcapping", "final_logit_softcapping"):
            raise CheckpointError(f"{path} lacks the metadata for {key}")

    hf_names = {hf_name(n, arch): n for n in names}
    vocabulary = {key: value for key, value in header.metadata.items() if key.startswith("tokenizer.")}

    def load(name: str, rows: slice) -> np.ndarray | GroupedTensor:
        t = names[hf_names[name]]
        try:
            data = _read_data(path, t, rows)
            w = grouped(t, data) if keep_groups and t.tensor_type.name in KEPT_TYPES else gguf.quants.dequantize(data, t.tensor_type)
        except Exception as e:
            raise CheckpointError(f"cannot dequantize {t.name} ({t.tensor_type.name}) in {path}: {e}") from None
        if arch == "llama" and name.endswith(("q_proj.weight", "k_proj.weight")):
            n_head = heads if name.endswith("q_proj.weight") else kv_heads
            w = w.rows(lambda a: unpermute_rows(a, n_head)) if isinstance(w, GroupedTensor) else unpermute_rows(w, n_head)
        elif gemma and name.endswith("norm.weight"):
            w = w - np.asarray(1, w.dtype)
        return w

    kept = {name: kept_format(names[gguf_name].tensor_type.name) for name, gguf_name in hf_names.items()} if keep_groups else {}
    def shape(name: str) -> tuple[int, ...]:
        return tuple(int(d) for d in reversed(names[hf_names[name]].shape))  # GGUF lists dims innermost first

    tensors = LazyTensors(list(hf_names), load, shape)
    return HFSource(config, tensors, _tokenizer(arch, vocabulary, path), path, {k: f for k, f in kept.items() if f})


# GGUF's block types that `quant`'s formats hold exactly, with the format (its group is the type's
# entries per scale) and where each block keeps its float16 factors: (d, m or dmin) byte offsets, then
# Q4_K's and Q5_K's 12 bytes of 6-bit scales and minimums, or Q6_K's 16 int8 scales. An entry is worth d * q (Q8_0),
# d * (q - 8) (Q4_0), d * q + m (Q4_1, Q5_1), d * (q - 16) (Q5_0), (d sc) q - (dmin m) per 32 (Q4_K,
# Q5_K), (d sc) (q - 32) per 16 (Q6_K), for the type's codes q.
KEPT_TYPES = {  # type: (format, d, m, scales)
    "Q8_0": ("int8", 0, None, None), "Q4_0": ("int4", 0, None, None), "Q4_1": ("int4", 0, 2, None),
    "Q5_0": ("int8", 0, None, None), "Q5_1": ("int8-min", 0, 2, None), "Q4_K": ("int4-f32", 0, 2, (4, 12)),
    "Q5_K": ("int8-min", 0, 2, (4, 12)), "Q6_K": ("int8-g16", 208, None, (192, 16)),
}
ROWS_PER_CHUNK = 4096  # a tensor's rows read at a time: its codes' float copy stays small


def kept_format(tensor_type: str) -> quant.Format | None:
    kept = KEPT_TYPES.get(tensor_type)
    return None if kept is None else quant.Format.parse(kept[0])


def _read_data(path: Path, t: GGUFTensor, rows: slice) -> np.ndarray:
    """A tensor's rows, in the type and shape gguf's dequantization takes, read from the file rather
    than through a memory map: every page of a map that is read stays resident, the whole file by the
    end of a conversion, where a read copy goes with the tensor."""
    start, stop, _ = rows.indices(t.array_shape[0])
    row = math.prod(t.array_shape[1:])
    offset = t.data_offset + start * row * t.array_dtype.itemsize
    return np.fromfile(path, dtype=t.array_dtype, count=(stop - start) * row, offset=offset).reshape(stop - start, *t.array_shape[1:])


def grouped(t, data: np.ndarray) -> GroupedTensor:
    """A tensor of one of `KEPT_TYPES` (its rows `data` of blocks) as codes and scales. The codes are gguf's own dequantization of
    the same blocks with every factor set to one (d = 1, m = dmin = 0, sub-block scales 1), so each
    type's bit layout is the library's; the factors are read from the blocks as the library reads them."""
    import gguf

    kind = t.tensor_type.name
    fmt_name, d_at, m_at, scales_at = KEPT_TYPES[kind]
    fmt = quant.Format.parse(fmt_name)
    rows, K = data.shape[0], int(t.shape[0])  # GGUF lists dims innermost first: shape[0] is the input
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[t.tensor_type]
    blocks = data.reshape(rows, K // block_size, block_bytes)

    def halves(at):
        return blocks[..., at : at + 2].copy().view(np.float16)[..., 0]  # [rows, blocks]

    d = halves(d_at)
    codes = np.empty((rows, K), np.uint8 if fmt.bits == 4 else np.int8)
    unit = np.zeros(block_bytes, np.uint8)
    unit[d_at : d_at + 2] = np.frombuffer(np.float16(1).tobytes(), np.uint8)
    if scales_at is not None:  # 6-bit scales of 1 and minimums of 0 (Q4_K, Q5_K), or int8 scales of 1 (Q6_K)
        start, size = scales_at
        unit[start : start + size] = [1, 1, 1, 1, 0, 0, 0, 0, 1, 1, 1, 1] if size == 12 else 1
    keep = np.ones(block_bytes, bool)  # the bytes of codes, which stay; the factors' bytes become `unit`'s
    keep[d_at : d_at + 2] = False
    if m_at is not None:
        keep[m_at : m_at + 2] = False
    if scales_at is not None:
        keep[scales_at[0] : sum(scales_at)] = False
    offset = {"Q4_0": 8}.get(kind, 0)  # Q4_0's q - 8 back to its codes 0..15
    for r0 in range(0, rows, ROWS_PER_CHUNK):
        chunk = np.where(keep, blocks[r0 : r0 + ROWS_PER_CHUNK], unit)
        values = gguf.quants.dequantize(chunk.reshape(chunk.shape[0], -1), t.tensor_type)
        codes[r0 : r0 + ROWS_PER_CHUNK] = values + offset
    if scales_at is None:
        scale, low = d, (halves(m_at) if m_at is not None else None)
        if kind == "Q4_0":  # d * (q - 8) = d * q + (-8 d), exactly in float16
            low = (-8 * d.astype(np.float32)).astype(np.float16)
        return GroupedTensor(codes, scale, low, fmt, kind)
    if kind == "Q6_K":
        sub = blocks[..., scales_at[0] : sum(scales_at)].copy().view(np.int8)  # [rows, blocks, 16]
        scale = (d.astype(np.float32)[..., None] * sub.astype(np.float32)).reshape(rows, -1)
        return GroupedTensor(codes, scale, None, fmt, kind)
    sc, m = gguf.quants.Q4_K.get_scale_min(blocks[..., scales_at[0] : sum(scales_at)].reshape(-1, 12))  # Q5_K packs them alike
    dmin = halves(m_at)
    scale = (d.astype(np.float32)[..., None] * sc.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)
    low = -(dmin.astype(np.float32)[..., None] * m.reshape(rows, -1, 8).astype(np.float32)).reshape(rows, -1)
    return GroupedTensor(codes, scale, low, fmt, kind)


def hf_name(name: str, arch: str = "llama") -> str:
    """The HF name of a GGUF tensor; unknown names pass through (and are refused later)."""
    m = re.fullmatch(r"blk\.(\d+)\.(.+)", name)
    key, i = (f"blk.{{i}}.{m.group(2)}", m.group(1)) if m else (name, None)
    table = GEMMA_NAMES if arch.startswith("gemma") else GGUF_NAMES
    return table[key].format(i=i) if key in table else name


def unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undoes llama.cpp's interleaving of q/k rows for its RoPE layout (back to rotate-half)."""
    rows, cols = w.shape
    return w.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)


GGUF_SPECIAL_TOKENS = {"bos_token": "bos_token_id", "eos_token": "eos_token_id", "unk_token": "unknown_token_id",
                       "pad_token": "padding_token_id"}


def _tokenizer(architecture: str, metadata: dict, path: Path):
    """The tokenizer a GGUF's `tokenizer.*` metadata describes, built as transformers builds it from a
    GGUF (`get_gguf_tokenizer`, then `convert_gguf_tokenizer`), from the fields already read: that
    function parses the file again, importing PyTorch, at some 400 MB more for a 150k vocabulary. It
    is the fast tokenizer that `checkpoint.load_tokenizer` reads back."""
    from transformers import PreTrainedTokenizerFast  # heavy: imported only when a tokenizer is read
    from transformers.integrations.gguf import GGUF_TOKENIZER_MAPPING, convert_gguf_tokenizer

    if "tokenizer.ggml.tokens" not in metadata:
        return None
    vocabulary, settings = (
        {name: metadata[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING[group].items() if f"tokenizer.{key}" in metadata}
        for group in ("tokenizer", "tokenizer_config")
    )
    if vocabulary.get("tokenizer_type") == "llama":
        settings.setdefault("add_bos_token", True)  # llama.cpp adds BOS to a sentencepiece vocabulary that does not say otherwise
    for name, key in GGUF_SPECIAL_TOKENS.items():
        token_id = metadata.get(f"tokenizer.ggml.{key}")
        settings[name] = vocabulary["tokens"][token_id] if token_id is not None else None
    try:
        backend, more = convert_gguf_tokenizer(architecture, vocabulary)
        return PreTrainedTokenizerFast(tokenizer_object=backend, **settings, **more)
    except Exception as e:  # the model converts without one; token ids still work.
        warnings.warn(f"no tokenizer from {path}: {type(e).__name__}: {e}", stacklevel=2)
        return None


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file as its header describes it."""

    name: str
    tensor_type: object  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]  # GGUF's order: innermost dimension first
    data_offset: int  # from the start of the file
    array_shape: tuple[int, ...]  # as gguf's dequantization takes it: rows of blocks' bytes for block types
    array_dtype: np.dtype


@dataclasses.dataclass(frozen=True)
class GGUFHeader:
    metadata: dict  # key -> str, int, float, bool, or a list of them
    tensors: dict[str, GGUFTensor]


class _Header:
    """A cursor over a GGUF file's header that checks each count, length, offset and shape it reads
    against the file's size before anything uses it: a lying count would otherwise become an
    allocation of exabytes deep inside numpy."""

    MIN_KV_BYTES = 8 + 4 + 1  # a key's length, its value's type, a one-byte value
    MIN_TENSOR_BYTES = 8 + 4 + 8 + 4 + 8  # a name's length, the dimension count, one dimension, the type, the offset
    MAX_DIMS = 4  # GGML_MAX_DIMS

    def __init__(self, path: Path, data):
        self.path, self.data, self.size, self.at = path, data, len(data), 0

    def fail(self, field: str, problem: str):
        raise CheckpointError(f"{self.path} has a corrupt GGUF header: {field} {problem} (the file has {self.size} bytes)")

    def take(self, fmt: str, field: str):
        n = struct.calcsize("<" + fmt)
        if self.at + n > self.size:
            self.fail(field, f"at byte {self.at} runs past the end of the file")
        value = struct.unpack_from("<" + fmt, self.data, self.at)[0]
        self.at += n
        return value

    def count(self, field: str, each: int) -> int:
        """A count of items of at least `each` bytes, checked to fit in what is left of the file."""
        n = self.take("Q", field)
        if n * each > self.size - self.at:
            self.fail(field, f"is {n}, more than the {self.size - self.at} bytes left could hold")
        return n

    def string(self, field: str) -> str:
        n = self.count(f"{field}'s length", 1)
        self.at += n
        try:
            return str(self.data[self.at - n : self.at], "utf-8")
        except UnicodeDecodeError as e:
            self.fail(field, f"is not UTF-8 ({e.reason} at byte {self.at - n + e.start})")

    def value(self, kind: int, field: str):
        """One metadata value: a str, int, float or bool, or a list of them (or of lists)."""
        if kind == _STRING:
            return self.string(field)
        if kind == _ARRAY:
            item = self.take("I", f"{field}'s item type")
            if item not in _SCALARS and item not in (_STRING, _ARRAY):
                self.fail(field, f"is an array of the unknown value type {item}")
            if item in _SCALARS:  # read whole: a vocabulary's scores are 150k of them
                dtype = np.dtype("<" + _SCALARS[item])
                n = self.count(f"{field}'s array length", dtype.itemsize)
                values = np.frombuffer(self.data, dtype, n, self.at).tolist()
                self.at += n * dtype.itemsize
                return values
            n = self.count(f"{field}'s array length", 8)
            return [self.value(item, f"{field}[{i}]") for i in range(n)]
        if kind not in _SCALARS:
            self.fail(field, f"has the unknown value type {kind}")
        return self.take(_SCALARS[kind], field)


# GGUF's metadata value types (the spec's numbering): struct formats of the scalars, and the two others.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9
# The element types of GGUF's unblocked tensor types; every other type is read as its blocks' bytes.
_ELEMENT_TYPES = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8, "I16": np.int16,
                  "I32": np.int32, "I64": np.int64}


def read_header(path: Path) -> GGUFHeader:
    """A GGUF file's metadata and tensor descriptions, each count, length, offset and shape checked
    against the file as it is read (GGUF versions 2 and 3, little-endian). Raises CheckpointError
    naming the field and the file. It reads only the header: the weights are read tensor by tensor."""
    import mmap

    import gguf

    with open(path, "rb") as f:
        if path.stat().st_size < 24:
            raise CheckpointError(f"cannot read {path} as a GGUF file: {path.stat().st_size} bytes is too short for its header")
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            h = _Header(path, data)
            if h.take("4s", "magic") != b"GGUF":
                raise CheckpointError(f"cannot read {path} as a GGUF file: it does not start with GGUF's magic bytes")
            version = h.take("I", "the version")
            if version not in (2, 3):
                h.fail("the version", f"is {version}; GGUF versions 2 and 3 are read")
            tensor_count = h.count("the tensor count", h.MIN_TENSOR_BYTES)
            kvs = h.count("the metadata count", h.MIN_KV_BYTES)
            metadata = {}
            for i in range(kvs):
                key = h.string(f"metadata key {i}")
                name = f"metadata {key!r}"
                value = h.value(h.take("I", f"{name}'s type"), name)
                if key in metadata:
                    h.fail(name, "is given twice")
                metadata[key] = value
            alignment = metadata.get("general.alignment", gguf.GGUF_DEFAULT_ALIGNMENT)
            if not isinstance(alignment, int) or isinstance(alignment, bool) or alignment < 1 or alignment & (alignment - 1):
                h.fail("metadata 'general.alignment'", f"is {alignment!r}, not a power of two")
            tensors, spans = {}, []  # offsets from the start of the data, until the header's end is known
            for i in range(tensor_count):
                tensor = h.string(f"tensor {i} name")
                name = f"tensor {i} ({tensor!r})"
                dims = h.take("I", f"{name}'s dimension count")
                if not 1 <= dims <= h.MAX_DIMS:
                    h.fail(f"{name}'s dimension count", f"is {dims}, not 1 to {h.MAX_DIMS}")
                shape = tuple(h.take("Q", f"{name}'s dimension {d}") for d in range(dims))
                kind = h.take("I", f"{name}'s type")
                if kind not in gguf.GGMLQuantizationType._value2member_map_:
                    h.fail(f"{name}'s type", f"is the unknown tensor type {kind}")
                kind = gguf.GGMLQuantizationType(kind)
                block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
                elements = math.prod(shape)
                if min(shape) < 1 or shape[0] % block or elements // block * block_bytes >= 1 << 63:  # llama.cpp's bound
                    h.fail(f"{name}'s shape", f"is {list(shape)}, not whole {kind.name} blocks of {block} below 2**63 bytes")
                offset = h.take("Q", f"{name}'s offset")
                if offset % alignment:
                    h.fail(f"{name}'s offset", f"is {offset}, not a multiple of the alignment {alignment}")
                if tensor in tensors:
                    h.fail(name, "is given twice")
                dtype = _ELEMENT_TYPES.get(kind.name)
                array_shape = shape[::-1] if dtype else gguf.quants.quant_shape_to_byte_shape(shape[::-1], kind)
                tensors[tensor] = GGUFTensor(tensor, kind, shape, offset, tuple(array_shape), np.dtype(dtype or np.uint8))
                spans.append((offset, offset + elements // block * block_bytes, name))
            start = h.at + (-h.at % alignment)
            spans.sort()
            for (_, end, first), (offset, _, second) in zip(spans, spans[1:]):
                if offset < end:
                    h.fail(f"{second}'s offset", f"is {offset}, inside the data of {first}")
            end = max((e for _, e, _ in spans), default=0)
            if start + end > h.size:
                if spans and start + spans[-1][0] >= h.size:
                    h.fail(f"{spans[-1][2]}'s offset", f"is {spans[-1][0]}, past the end of the file's data")
                raise CheckpointError(f"{path} is truncated: its header describes {start + end} bytes, the file has {h.size}")
    return GGUFHeader(metadata, {n: dataclasses.replace(t, data_offset=start + t.data_offset) for n, t in tensors.items()})
