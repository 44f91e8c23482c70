"""Model configuration: a static, hashable dataclass built from a Hugging Face `config.json`."""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
import re
from typing import Any

import jax.numpy as jnp

ARCHITECTURES = ("llama", "mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3_text")
GEMMA = ("gemma2", "gemma3_text")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")  # the MLP's gate: SwiGLU, or GeGLU with tanh-approximated GELU
LAYER_TYPES = ("full_attention", "sliding_attention")  # transformers' names
ROPE_TYPES = ("linear", "llama3")  # supported RoPE scalings besides plain RoPE
FLOAT_DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
# Weight-only formats (s3d_jax/quant.py): the projections' weights quantized, the rest in float32.
QUANTIZED_DTYPES = ("int8", "int4")
# A model's dtype and the float type of its unquantized weights.
DTYPES = {**FLOAT_DTYPES, **{name: jnp.float32 for name in QUANTIZED_DTYPES}}
# Activations and the KV cache at every dtype: rounded to 16 bits, a verify pass's last-bit differences
# from a one-token step would become visible ones (docs/design.md, "Precision").
COMPUTE_DTYPE = jnp.float32
ACTIVATION_MODES = ("float32", "int8")  # ModelConfig.activations
QUANT_GROUP = 32  # a quantized weight's entries per scale, along its input (s3d_jax/quant.py)
# A quantized weight's format by name (`quant.Format`): int8 or int4, then -g16 (groups of 16),
# -min (an int8 minimum), -f32 (int4's float32 scales).
WEIGHT_FORMAT = re.compile(r"int(8|4)(-g16)?(-min)?(-f32)?")


def weight_format_fields(name: str) -> tuple[int, int, bool, str] | None:
    """A format's name as (bits, group, minimum, scale dtype), `quant.Format`'s fields; None for a name
    that is not one (-min belongs to int8, -f32 to int4, whose minimum is always there)."""
    m = WEIGHT_FORMAT.fullmatch(name)
    if m is None or (m[1] == "8" and m[4]) or (m[1] == "4" and m[3]):
        return None
    bits = int(m[1])
    return bits, 16 if m[2] else QUANT_GROUP, bits == 4 or bool(m[3]), "float32" if bits == 8 or m[4] else "float16"

FORMATTED_WEIGHTS = ("qkv", "o", "gate_up", "down", "embed", "lm_head")  # those a config may give a format of its own


class ConfigError(ValueError):
    """A model config that this project cannot run."""


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling (transformers' `rope_parameters`): `linear` divides every frequency by
    `factor`; `llama3` (Llama-3.1/3.2) divides the low frequencies by `factor`, keeps the high ones,
    and interpolates between the two wavelengths `original_max_position_embeddings / *_freq_factor`."""

    rope_type: str
    factor: float
    low_freq_factor: float = 1.0  # llama3 only, as are the next two
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in ROPE_TYPES:
            raise ConfigError(f"unsupported rope_scaling type {self.rope_type!r}; supported: default, {', '.join(ROPE_TYPES)}")
        if not self.factor > 0:
            raise ConfigError(f"rope_scaling factor must be positive, got {self.factor!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor > 0:
            raise ConfigError(
                f"rope_scaling needs high_freq_factor > low_freq_factor > 0, got {self.high_freq_factor} and {self.low_freq_factor}"
            )


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_embeddings: bool = False
    max_position_embeddings: int = 4096
    sliding_window: int | None = None
    dtype: str = "float32"
    # S3D: the mask token's embedding row, and the drafter defaults a trained checkpoint records.
    mask_token_id: int | None = None
    # Rows of the vocabulary at and past this index are padding (added so the head's matmul has a
    # multiple-of-128 shape): never produced, like the mask row. None: no padding.
    output_vocab_size: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    draft_skip: tuple[int, int] | None = None
    draft_gamma: int | None = None
    draft_lora_rank: int = 0  # > 0: draft passes add LoRA adapters; the verifier never does
    # The float type of the drafter's own weights (the adapters, a float table's reduced draft head). None:
    # the weights' (`jnp_dtype`), as training holds them; an applied drafter holds them in bfloat16
    # (`drafter.DECODE_DTYPE`): they only shape drafts, which the verifier checks.
    draft_dtype: str | None = None
    # > 0: draft passes score only this many tokens (the drafter's most frequent ones, FR-Spec),
    # through the `draft_vocab` ids and their `draft_head` columns; verification keeps the full head.
    draft_vocab_size: int = 0
    draft_tree: int = 0  # > 0: S3D decodes with a token tree of this many nodes unless told otherwise
    # Per-family options; the defaults are LLaMA's.
    rope_scaling: RopeScaling | None = None  # of the full-attention layers (Llama-3.1, Gemma-3)
    layer_types: tuple[str, ...] | None = None  # per layer, from LAYER_TYPES; None: every layer alike (see `is_sliding`)
    local_rope_theta: float | None = None  # Gemma-3: the RoPE base of sliding-window layers, which are never scaled
    hidden_act: str = "silu"  # the MLP's gate, from ACTIVATIONS
    qkv_bias: bool = False  # Qwen2: biases on q, k and v
    qk_norm: bool = False  # Qwen3, Gemma-3: an RMSNorm over each head of q and k, before RoPE
    norm_plus_one: bool = False  # Gemma: RMSNorm scales by (1 + w), computed in float32
    post_norms: bool = False  # Gemma: also a norm on the attention output and on the MLP output, before each residual
    scale_embeddings: bool = False  # Gemma: embeddings times sqrt(hidden_size), rounded to the weights' dtype
    query_pre_attn_scalar: float | None = None  # Gemma: scores scale by its -1/2 power instead of head_dim's
    attn_softcap: float | None = None  # Gemma-2: attention scores become cap * tanh(score / cap)
    final_softcap: float | None = None  # Gemma-2: the same on the logits
    # A quantized model's weights held in other formats than its dtype's, as (name, format) pairs: a
    # GGUF's blocks kept exactly (`quant.Format`), e.g. ("down", "int8-g16-min") for Q4_K and Q6_K layers.
    weight_formats: tuple[tuple[str, str], ...] = ()
    # How a quantized weight's products read the activations on a CPU: "float32" as they are, or "int8",
    # quantized per row and block of 16 inputs and summed with integer multiply-adds (llama.cpp's way:
    # faster for several rows, slightly other numbers). A loading choice, not the weights'.
    activations: str = "float32"

    def __post_init__(self):
        for f in dataclasses.fields(self):  # types first: a JSON "64" or true is not an int
            object.__setattr__(self, f.name, _typed(f.name, getattr(self, f.name), f.type))
        if self.architecture not in ARCHITECTURES:
            raise ConfigError(f"unknown architecture {self.architecture!r}; supported: {', '.join(ARCHITECTURES)}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"unsupported dtype {self.dtype!r}; supported: {', '.join(DTYPES)}")
        if self.activations not in ACTIVATION_MODES:
            raise ConfigError(f"unsupported activations {self.activations!r}; supported: {', '.join(ACTIVATION_MODES)}")
        if self.draft_dtype is not None and self.draft_dtype not in FLOAT_DTYPES:
            raise ConfigError(f"unsupported draft_dtype {self.draft_dtype!r}; supported: {', '.join(FLOAT_DTYPES)}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads", "num_kv_heads", "head_dim",
                     "max_position_embeddings", "sliding_window", "draft_gamma"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ConfigError(f"config field {name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("rope_theta", "rms_norm_eps"):
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) > 0):
                raise ConfigError(f"config field {name} must be a positive finite number, got {getattr(self, name)!r}")
        for name in ("draft_lora_rank", "draft_tree"):
            if getattr(self, name) < 0:
                raise ConfigError(f"config field {name} must be >= 0, got {getattr(self, name)}")
        if self.draft_lora_rank and self.draft_skip is None:
            raise ConfigError("draft_lora_rank needs draft_skip: the adapters are stacked over the draft layers")
        if not 0 <= self.draft_vocab_size <= self.produced_vocab_size:
            raise ConfigError(
                f"config field draft_vocab_size must be in [0, {self.produced_vocab_size}] (the tokens the "
                f"model can produce), got {self.draft_vocab_size}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.mask_token_id is not None and not 0 <= self.mask_token_id < self.vocab_size:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is outside the vocabulary of {self.vocab_size}")
        if self.output_vocab_size is not None and not 0 < self.output_vocab_size <= self.vocab_size:
            raise ConfigError(f"output_vocab_size {self.output_vocab_size} must be in [1, vocab_size {self.vocab_size}]")
        for eos in self.eos_token_ids:
            if not 0 <= eos < self.vocab_size:
                raise ConfigError(f"eos token id {eos} is outside the vocabulary of {self.vocab_size}")
        if self.mask_token_id is not None and self.mask_token_id in self.eos_token_ids:
            raise ConfigError(f"mask_token_id {self.mask_token_id} is an EOS id too: the mask is never emitted, so decoding would not stop")
        if self.draft_skip is not None:
            validate_skip(self.draft_skip, self.num_layers)
        if self.quantized:
            for name in ("hidden_size", "intermediate_size", "head_dim"):  # the projections' input sizes
                if getattr(self, name) % QUANT_GROUP:
                    raise ConfigError(f"dtype {self.dtype} quantizes weights in groups of {QUANT_GROUP} along their input, and "
                                      f"this model's {name} of {getattr(self, name)} is not a multiple of {QUANT_GROUP}")
        formats = self.weight_formats.items() if isinstance(self.weight_formats, dict) else self.weight_formats
        object.__setattr__(self, "weight_formats", tuple(sorted((str(n), str(f)) for n, f in formats)))
        for name, fmt in self.weight_formats:
            if not self.quantized:
                raise ConfigError(f"weight_formats name formats of quantized weights, and dtype {self.dtype} quantizes none")
            if name not in FORMATTED_WEIGHTS or weight_format_fields(fmt) is None:
                raise ConfigError(f"weight_formats: {name}={fmt!r} is not a weight and a format ({', '.join(FORMATTED_WEIGHTS)}; "
                                  "int8 or int4, then -g16, -min (int8), -f32 (int4))")
        if self.hidden_act not in ACTIVATIONS:
            raise ConfigError(f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(ACTIVATIONS)}")
        # Normalise JSON dicts and lists into hashable dataclasses and tuples.
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScaling(**self.rope_scaling))
        if self.layer_types is not None:
            object.__setattr__(self, "layer_types", _normalized_layer_types(self.layer_types, self.num_layers, self.sliding_window))

    @property
    def jnp_dtype(self):
        """The float type of unquantized weights (activations and the KV cache are float32)."""
        return DTYPES[self.dtype]

    @property
    def draft_jnp_dtype(self):
        """The float type of the drafter's own weights (`draft_dtype`)."""
        return self.jnp_dtype if self.draft_dtype is None else FLOAT_DTYPES[self.draft_dtype]

    @property
    def quantized(self) -> bool:
        """Whether the projections' weights are held in a weight-only format (`QUANTIZED_DTYPES`)."""
        return self.dtype in QUANTIZED_DTYPES

    @property
    def precision(self) -> str:
        """Every contraction's precision. Float32 weights get true float32 matmuls: a GPU's default
        rounds their operands to TF32 (10 mantissa bits), which a pass of several tokens and a step
        of one round differently, enough to change greedy tokens. A CPU computes float32 either way."""
        return "highest" if self.jnp_dtype == jnp.float32 else "default"

    @property
    def produced_vocab_size(self) -> int:
        """The tokens the model produces and reads: its tokenizer's, without the rows a conversion
        appends or pads with (`output_vocab_size`)."""
        return self.output_vocab_size or self.vocab_size

    @property
    def all_layers(self) -> tuple[int, ...]:
        return tuple(range(self.num_layers))

    def is_sliding(self, layer: int) -> bool:
        """Whether `layer` is a sliding-window layer; with no `layer_types`, every layer is when there is a window."""
        if self.layer_types is None:
            return self.sliding_window is not None
        return self.layer_types[layer] == "sliding_attention"

    def layer_rope(self, layer: int) -> tuple[float, RopeScaling | None]:
        """RoPE base and scaling of `layer` (Gemma-3's sliding-window layers have their own, unscaled)."""
        if self.local_rope_theta is not None and self.is_sliding(layer):
            return self.local_rope_theta, None
        return self.rope_theta, self.rope_scaling

    def draft_layers(self, skip: tuple[int, int]) -> tuple[int, ...]:
        """The layers the S3D drafter runs: every layer outside the inclusive skip range [l, h]."""
        low, high = validate_skip(skip, self.num_layers)
        return tuple(i for i in range(self.num_layers) if not low <= i <= high)

    def replace(self, **changes) -> ModelConfig:
        """The config with `changes`; another dtype drops `weight_formats`, which belong to the old one's weights."""
        if changes.get("dtype", self.dtype) != self.dtype:
            changes.setdefault("weight_formats", ())
        return dataclasses.replace(self, **changes)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelConfig:
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as e:
            raise ConfigError(f"config is not valid JSON: {e}") from None
        if not isinstance(fields, dict):
            raise ConfigError(f"config must be a JSON object, got {type(fields).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(fields) - known)
        if unknown:
            raise ConfigError(f"unknown config fields: {', '.join(unknown)}")
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING}
        if required - set(fields):
            raise ConfigError(f"config fields missing: {', '.join(sorted(required - set(fields)))}")
        return cls(**fields)

    @classmethod
    def from_hf(cls, hf: dict[str, Any], dtype: str = "float32") -> ModelConfig:
        """Builds a config from a Hugging Face `config.json` dict, refusing features this model lacks.
        Reads both transformers 5's layout (`rope_parameters`, `layer_types`) and the older one."""
        arch = hf.get("model_type")
        if arch not in ARCHITECTURES:
            hint = " (the multimodal Gemma-3; its text model, gemma3_text, is supported)" if arch == "gemma3" else ""
            raise ConfigError(f"unknown architecture model_type={arch!r}{hint}; supported: {', '.join(ARCHITECTURES)}")
        _refuse_unsupported(hf, arch)
        num_heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
        gemma = arch in GEMMA
        theta, scaling = _rope(hf, arch, "full_attention")
        local_theta = _rope(hf, arch, "sliding_attention")[0] if arch == "gemma3_text" else None
        window, layer_types = _sliding_layers(hf, arch)
        return cls(
            architecture=arch,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // num_heads,
            rope_theta=float(theta),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6 if arch in ("qwen2", "qwen3", *GEMMA) else 1e-5)),
            tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
            max_position_embeddings=int(hf.get("max_position_embeddings", 4096)),
            sliding_window=window,
            dtype=dtype,
            eos_token_ids=tuple(eos),
            rope_scaling=scaling,
            layer_types=layer_types,
            local_rope_theta=None if local_theta is None else float(local_theta),
            hidden_act=_activation(hf, arch),
            qkv_bias=arch == "qwen2",
            qk_norm=arch in ("qwen3", "gemma3_text"),
            norm_plus_one=gemma,
            post_norms=gemma,
            scale_embeddings=gemma,
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar", 256)) if gemma else None,
            attn_softcap=hf.get("attn_logit_softcapping", 50.0 if arch == "gemma2" else None) if gemma else None,
            final_softcap=hf.get("final_logit_softcapping", 30.0 if arch == "gemma2" else None) if gemma else None,
        )


def _normalized_layer_types(layer_types, num_layers: int, sliding_window: int | None) -> tuple[str, ...] | None:
    """A tuple with one known type per layer, or None when every layer is what None means anyway."""
    types = tuple(layer_types)
    for t in types:
        if t not in LAYER_TYPES:
            raise ConfigError(f"unsupported config field layer_types entry {t!r}; supported: {', '.join(LAYER_TYPES)}")
    if len(types) != num_layers:
        raise ConfigError(f"layer_types has {len(types)} entries for {num_layers} layers")
    uniform = "sliding_attention" if sliding_window is not None else "full_attention"
    return None if all(t == uniform for t in types) else types


def _activation(hf: dict[str, Any], arch: str) -> str:
    """The MLP gate's activation. Gemma's modeling code reads `hidden_activation` (older Gemma-2 configs
    also carry a `hidden_act`, which it ignores)."""
    field, wanted = ("hidden_activation", "gelu_pytorch_tanh") if arch in GEMMA else ("hidden_act", "silu")
    act = hf.get(field) or wanted
    if act != wanted:
        raise ConfigError(f"unsupported config field {field}={act!r}: {arch} is implemented with {wanted!r} only")
    return act


def _rope(hf: dict[str, Any], arch: str, layer_type: str) -> tuple[float, RopeScaling | None]:
    """RoPE base and scaling of `layer_type` layers. transformers 5 keeps them in `rope_parameters`
    (per layer type for Gemma-3); older configs in `rope_theta`, `rope_scaling` and Gemma-3's
    `rope_local_base_freq`. As in transformers, a `rope_scaling` overrides `rope_parameters`, and
    Gemma-3's applies to its full-attention layers only."""
    params = hf.get("rope_parameters") or {}
    local = arch == "gemma3_text" and layer_type == "sliding_attention"
    if set(params) & set(LAYER_TYPES):
        params = params.get(layer_type) or {}
    elif local:
        params = {"rope_theta": hf.get("rope_local_base_freq", 10000.0)}
    if hf.get("rope_scaling") and not local:
        params = {**{k: v for k, v in params.items() if k not in ("rope_type", "type")}, **hf["rope_scaling"]}
    default_theta = 1e6 if arch == "gemma3_text" and layer_type == "full_attention" else 10000.0
    theta = params.get("rope_theta") or hf.get("rope_theta") or default_theta
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    if rope_type not in ROPE_TYPES:
        why = ": its frequencies change with the sequence length" if rope_type == "dynamic" else ""
        raise ConfigError(f"unsupported config field rope_scaling type {rope_type!r}{why}; supported: default, {', '.join(ROPE_TYPES)}")
    if arch == "gemma3_text" and layer_type == "sliding_attention":
        raise ConfigError(f"unsupported config field rope_parameters.sliding_attention type {rope_type!r}: only plain RoPE there")
    try:
        if rope_type == "linear":
            return theta, RopeScaling("linear", float(params["factor"]))
        return theta, RopeScaling(
            "llama3",
            float(params["factor"]),
            float(params["low_freq_factor"]),
            float(params["high_freq_factor"]),
            int(params.get("original_max_position_embeddings") or hf.get("max_position_embeddings", 8192)),
        )
    except KeyError as e:
        raise ConfigError(f"rope_scaling of type {rope_type!r} lacks the field {e.args[0]}") from None


def _sliding_layers(hf: dict[str, Any], arch: str) -> tuple[int | None, list[str] | None]:
    """(sliding window, per-layer types or None) as each family's transformers code derives them."""
    n = hf["num_hidden_layers"]
    if arch == "llama":
        return None, None
    if arch in ("mistral", "phi3"):  # one window for every layer
        return hf.get("sliding_window"), None
    if arch in ("qwen2", "qwen3"):  # windows only with use_sliding_window, on layers from max_window_layers on
        window = hf.get("sliding_window") if hf.get("use_sliding_window") else None
        first = hf.get("max_window_layers", 28)
        default = ["sliding_attention" if window is not None and i >= first else "full_attention" for i in range(n)]
    else:  # Gemma: every `pattern`-th layer is global, the others slide
        window = hf.get("sliding_window", 4096)
        pattern = 2 if arch == "gemma2" else hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        default = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)]
    return window, hf.get("layer_types") or default


def _refuse_unsupported(hf: dict[str, Any], arch: str) -> None:
    # Qwen2 always has q/k/v biases (and no `attention_bias` field); elsewhere the flag adds an o bias too.
    flags = ("mlp_bias",) if arch == "qwen2" else ("attention_bias", "mlp_bias")
    for flag in flags:
        if hf.get(flag):
            raise ConfigError(f"unsupported config field {flag}=True: biases are not implemented for {arch}")
    if hf.get("use_bidirectional_attention"):
        raise ConfigError("unsupported config field use_bidirectional_attention=True: only causal attention is implemented")
    # transformers 5 may keep partial_rotary_factor inside `rope_parameters` (Phi-3 does).
    partial = hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"unsupported config field partial_rotary_factor={partial}: only full RoPE is implemented")


def _is_int(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_ints(value) -> bool:
    return isinstance(value, (list, tuple)) and all(map(_is_int, value))


_TYPES = {  # annotation: (accepts, normalises); numpy ints become ints, ints floats, lists tuples
    "int": (_is_int, int),
    "float": (lambda v: isinstance(v, numbers.Real) and not isinstance(v, bool), float),
    "bool": (lambda v: isinstance(v, bool), bool),
    "str": (lambda v: isinstance(v, str), str),
    "tuple[int, ...]": (_is_ints, lambda v: tuple(map(int, v))),
    "tuple[int, int]": (_is_ints, lambda v: tuple(map(int, v))),
}


def _typed(name: str, value, annotation: str):
    """`value` as the plain Python type its annotation names; ConfigError for anything else (a
    string "64", or a bool where a number belongs). Annotations not in `_TYPES` are not checked."""
    base, _, optional = annotation.partition(" | ")
    if base not in _TYPES or value is None and optional == "None":
        return value
    accepts, normalise = _TYPES[base]
    if not accepts(value):
        raise ConfigError(f"config field {name} must be {annotation.replace(' | None', ' or None')}, got {value!r}")
    return normalise(value)


def validate_skip(skip, num_layers: int) -> tuple[int, int]:
    """Checks an inclusive skip range [l, h] and returns it as a tuple of ints."""
    if isinstance(skip, (str, bytes)) or not hasattr(skip, "__len__") or len(skip) != 2 or not all(map(_is_int, skip)):
        raise ConfigError(f"skip range must be a pair of ints (l, h), got {skip!r}")
    low, high = (int(i) for i in skip)
    if not 0 <= low <= high < num_layers:
        raise ConfigError(f"skip range [{low}, {high}] is outside the model's layers 0..{num_layers - 1}")
    if high - low + 1 == num_layers:
        raise ConfigError(f"skip range [{low}, {high}] skips every layer and leaves no draft layer")
    return low, high
