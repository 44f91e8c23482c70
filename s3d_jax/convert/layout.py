"""The Hugging Face weight layout: one table, `RULES`, read in both directions.

Each rule names an HF tensor (torch layout, `{i}` for the layer) and the params it holds in this
project's tree. `params_from_hf` reads the table forwards and `params_to_hf` backwards, so import
and export cannot disagree. The rules name the projections' parts (q, k, v; gate, up), which
`FUSED` then joins into the model's fused weights (`model`) and splits again for export. Phi-3 fuses
q, k, v into one tensor and gate, up into another: a rule with several params splits the HF rows
among them, in order. A rule's `when` names the configs whose
checkpoints hold its tensor: Qwen2's biases, the q/k norms of Qwen3 and Gemma-3, and Gemma's four
norms per layer, where `post_attention_layernorm` is the attention output's norm and not, as in
LLaMA, the MLP's input norm. Gemma's norm weights are stored as they are and the model adds the 1
(`ModelConfig.norm_plus_one`): folding it into the scale would round small weights away in bfloat16,
and taking it off again at export is not exact for every float32 scale (those below 0.5).
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable
from typing import NamedTuple

import jax
import numpy as np
from flax.traverse_util import flatten_dict

from s3d_jax import quant
from s3d_jax.config import ModelConfig
from s3d_jax.model import join_qkv, split_qkv

FUSED_ARCHITECTURES = ("phi3",)  # whose checkpoints hold qkv_proj and gate_up_proj


@dataclasses.dataclass(frozen=True)
class Reshape:
    """Between an HF weight (or its rows of a fused tensor) and one of our params, both ways."""

    hf_shape: Callable[[ModelConfig], tuple[int, ...]]
    from_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]
    to_hf: Callable[[np.ndarray, ModelConfig], np.ndarray]


def _same(x, c):
    return x


def _transposed(hf_shape) -> Reshape:  # torch Linear [out, in] <-> [in, out]
    return Reshape(hf_shape, lambda w, c: w.T, lambda a, c: a.T)


NORM = Reshape(lambda c: (c.hidden_size,), _same, _same)  # [D] RMSNorm scales
VOCAB_TABLE = _transposed(lambda c: (c.vocab_size, c.hidden_size))  # embedding or head: [V, D] <-> [D, V]
QUERY = Reshape(  # [H*E, D] <-> [D, H, E]
    lambda c: (c.num_heads * c.head_dim, c.hidden_size),
    lambda w, c: w.T.reshape(c.hidden_size, c.num_heads, c.head_dim),
    lambda a, c: a.reshape(c.hidden_size, -1).T,
)
KEY_VALUE = Reshape(  # [K*E, D] <-> [D, K, E]
    lambda c: (c.num_kv_heads * c.head_dim, c.hidden_size),
    lambda w, c: w.T.reshape(c.hidden_size, c.num_kv_heads, c.head_dim),
    lambda a, c: a.reshape(c.hidden_size, -1).T,
)
OUTPUT = Reshape(  # [D, H*E] <-> [H, E, D]
    lambda c: (c.hidden_size, c.num_heads * c.head_dim),
    lambda w, c: w.T.reshape(c.num_heads, c.head_dim, c.hidden_size),
    lambda a, c: a.reshape(-1, c.hidden_size).T,
)
QUERY_BIAS = Reshape(  # [H*E] <-> [H, E]
    lambda c: (c.num_heads * c.head_dim,), lambda b, c: b.reshape(c.num_heads, c.head_dim), lambda a, c: a.reshape(-1)
)
KEY_VALUE_BIAS = Reshape(  # [K*E] <-> [K, E]
    lambda c: (c.num_kv_heads * c.head_dim,), lambda b, c: b.reshape(c.num_kv_heads, c.head_dim), lambda a, c: a.reshape(-1)
)
HEAD_NORM = Reshape(lambda c: (c.head_dim,), _same, _same)  # [E] q/k norm scales
FFN_IN = _transposed(lambda c: (c.intermediate_size, c.hidden_size))  # [F, D] <-> [D, F]
FFN_OUT = _transposed(lambda c: (c.hidden_size, c.intermediate_size))  # [D, F] <-> [F, D]


@dataclasses.dataclass(frozen=True)
class Rule:
    hf_name: str  # `{i}` stands for the layer index
    params: tuple[tuple[str, Reshape], ...]  # our `/`-separated param paths; several split the HF rows in order
    fused: bool | None = None  # export only: True in Phi-3's fused layout, False in the separate one, None in both
    when: Callable[[ModelConfig], bool] = lambda c: True  # the configs whose checkpoints hold this tensor

    @property
    def targets(self) -> tuple[str, ...]:
        return tuple(path for path, _ in self.params)

    @property
    def regex(self) -> re.Pattern:
        return re.compile(re.escape(self.hf_name).replace(r"\{i\}", r"(\d+)"))

    def hf_shape(self, c: ModelConfig) -> tuple[int, ...]:
        shapes = [reshape.hf_shape(c) for _, reshape in self.params]
        return (sum(s[0] for s in shapes), *shapes[0][1:])

    def from_hf(self, w: np.ndarray, c: ModelConfig) -> tuple[np.ndarray, ...]:
        """One array per target."""
        ends = np.cumsum([reshape.hf_shape(c)[0] for _, reshape in self.params])
        parts = np.split(w, ends[:-1])
        return tuple(reshape.from_hf(part, c) for (_, reshape), part in zip(self.params, parts, strict=True))

    def to_hf(self, arrays, c: ModelConfig) -> np.ndarray:
        """The HF tensor from one array per target."""
        return np.concatenate([reshape.to_hf(a, c) for (_, reshape), a in zip(self.params, arrays, strict=True)])


def _post_norms(c: ModelConfig) -> bool:
    return c.post_norms


def _pre_norms_only(c: ModelConfig) -> bool:
    return not c.post_norms


def _qkv_bias(c: ModelConfig) -> bool:
    return c.qkv_bias


def _qk_norm(c: ModelConfig) -> bool:
    return c.qk_norm


_LAYER, _OURS = "model.layers.{i}.", "layer_{i}/"
RULES = (
    Rule("model.embed_tokens.weight", (("embed", VOCAB_TABLE),)),
    Rule("lm_head.weight", (("lm_head", VOCAB_TABLE),)),
    Rule("model.norm.weight", (("final_norm/scale", NORM),)),
    Rule(_LAYER + "input_layernorm.weight", ((_OURS + "attn_norm/scale", NORM),)),
    Rule(_LAYER + "post_attention_layernorm.weight", ((_OURS + "mlp_norm/scale", NORM),), when=_pre_norms_only),
    # Gemma: a norm after attention, one before the MLP and one after it.
    Rule(_LAYER + "post_attention_layernorm.weight", ((_OURS + "attn_post_norm/scale", NORM),), when=_post_norms),
    Rule(_LAYER + "pre_feedforward_layernorm.weight", ((_OURS + "mlp_norm/scale", NORM),), when=_post_norms),
    Rule(_LAYER + "post_feedforward_layernorm.weight", ((_OURS + "mlp_post_norm/scale", NORM),), when=_post_norms),
    Rule(_LAYER + "self_attn.q_proj.bias", ((_OURS + "attn/q_bias", QUERY_BIAS),), when=_qkv_bias),
    Rule(_LAYER + "self_attn.k_proj.bias", ((_OURS + "attn/k_bias", KEY_VALUE_BIAS),), when=_qkv_bias),
    Rule(_LAYER + "self_attn.v_proj.bias", ((_OURS + "attn/v_bias", KEY_VALUE_BIAS),), when=_qkv_bias),
    Rule(_LAYER + "self_attn.q_norm.weight", ((_OURS + "attn/q_norm/scale", HEAD_NORM),), when=_qk_norm),
    Rule(_LAYER + "self_attn.k_norm.weight", ((_OURS + "attn/k_norm/scale", HEAD_NORM),), when=_qk_norm),
    Rule(_LAYER + "self_attn.q_proj.weight", ((_OURS + "attn/q", QUERY),), fused=False),
    Rule(_LAYER + "self_attn.k_proj.weight", ((_OURS + "attn/k", KEY_VALUE),), fused=False),
    Rule(_LAYER + "self_attn.v_proj.weight", ((_OURS + "attn/v", KEY_VALUE),), fused=False),
    Rule(_LAYER + "self_attn.o_proj.weight", ((_OURS + "attn/o", OUTPUT),)),
    Rule(_LAYER + "mlp.gate_proj.weight", ((_OURS + "mlp/gate", FFN_IN),), fused=False),
    Rule(_LAYER + "mlp.up_proj.weight", ((_OURS + "mlp/up", FFN_IN),), fused=False),
    Rule(_LAYER + "mlp.down_proj.weight", ((_OURS + "mlp/down", FFN_OUT),)),
    # Phi-3's fused projections.
    Rule(
        _LAYER + "self_attn.qkv_proj.weight",
        ((_OURS + "attn/q", QUERY), (_OURS + "attn/k", KEY_VALUE), (_OURS + "attn/v", KEY_VALUE)),
        fused=True,
    ),
    Rule(_LAYER + "mlp.gate_up_proj.weight", ((_OURS + "mlp/gate", FFN_IN), (_OURS + "mlp/up", FFN_IN)), fused=True),
)
IGNORED = (re.compile(r".*\.rotary_emb\.inv_freq"),)  # buffers some old checkpoints saved


def _join_qkv(q, k, v, c: ModelConfig):  # [.., H, E], [.., K, E] x2 -> [.., K, G + 2, E]
    return join_qkv(q, k, v, c.num_kv_heads)


def _split_qkv(qkv, c: ModelConfig):
    q, k, v = split_qkv(qkv, c.num_heads // c.num_kv_heads)
    return q.reshape(*q.shape[:-3], c.num_heads, q.shape[-1]), k, v


def _join_gate_up(gate, up, c: ModelConfig):  # [.., F] x2 -> [.., 2, F]
    return np.stack([gate, up], axis=-2)


def _split_gate_up(gate_up, c: ModelConfig):
    return gate_up[..., 0, :], gate_up[..., 1, :]


class Fused(NamedTuple):
    """One of the model's fused weights: the params it joins, and how (on the trailing, output axes, so
    a quantized weight's values, scales and minimums join alike)."""

    parts: tuple[str, ...]
    join: Callable
    split: Callable


FUSED = {
    "attn/qkv": Fused(("attn/q", "attn/k", "attn/v"), _join_qkv, _split_qkv),
    "attn/qkv_bias": Fused(("attn/q_bias", "attn/k_bias", "attn/v_bias"), _join_qkv, _split_qkv),
    "mlp/gate_up": Fused(("mlp/gate", "mlp/up"), _join_gate_up, _split_gate_up),
}


def _fused_name(path: str) -> tuple[str, str] | None:
    """`layer_3/attn/qkv` -> ("layer_3/", "attn/qkv") for a fused weight, else None."""
    m = re.fullmatch(r"(layer_\d+/)(.*)", path)
    return (m.group(1), m.group(2)) if m and m.group(2) in FUSED else None


def _each(fn, arrays, pieces: int | None = None):
    """`fn` over plain arrays, or over each component (values, scale, min) of quantized ones; where `fn`
    returns `pieces` arrays, each piece of a quantized weight is a quantized weight of its own."""
    if not quant.is_quantized(arrays[0]):
        return fn(*arrays)
    done = {key: fn(*[a[key] for a in arrays]) for key in arrays[0]}
    return done if pieces is None else [{key: done[key][i] for key in done} for i in range(pieces)]


def join_parts(flat: dict, config: ModelConfig) -> dict:
    """A flat `/`-named params dict holding the parts of the fused weights, with each group of parts
    replaced by its fused weight, in place (a layer at a time, so the model is never held twice)."""
    for layer in sorted({path.split("/", 1)[0] + "/" for path in flat if path.startswith("layer_")}):
        for name, fused in FUSED.items():
            paths = [layer + part for part in fused.parts]
            if all(p in flat for p in paths):
                arrays = [flat.pop(p) for p in paths]
                flat[layer + name] = _each(lambda *a, j=fused.join: np.ascontiguousarray(j(*a, config)), arrays)
    return flat


def split_parts(flat: dict, config: ModelConfig) -> dict:
    """The inverse of `join_parts`: each fused weight as its parts (views of it where the layout allows)."""
    out = {}
    for path, w in flat.items():
        found = _fused_name(path)
        if found is None:
            out[path] = w
            continue
        layer, name = found
        fused = FUSED[name]
        split = _each(lambda v, s=fused.split: s(v, config), [w], len(fused.parts))
        out.update({layer + part: piece for part, piece in zip(fused.parts, split, strict=True)})
    return out


def unstack_layers(flat: dict) -> dict:
    """Each layer stack `layers/<name>` as `layer_{i}/<name>` (views of the stack)."""
    out = {}
    for path, w in flat.items():
        if not path.startswith("layers/"):
            out[path] = w
            continue
        name = path.removeprefix("layers/")
        count = jax.tree.leaves(w)[0].shape[0]
        out.update({f"layer_{i}/{name}": jax.tree.map(lambda x, i=i: x[i], w) for i in range(count)})
    return out


def params_to_hf(params, config: ModelConfig) -> dict[str, np.ndarray]:
    """HF tensor names in torch layouts, float32. Draft-only LoRA weights have no HF counterpart and are
    left out: the full model does not use them."""
    flat = split_parts(unstack_layers(flatten_dict(params, sep="/", is_leaf=lambda _, node: quant.is_quantized(node))), config)
    fused = config.architecture in FUSED_ARCHITECTURES
    out = {}
    for rule in RULES:
        if (rule.fused is not None and rule.fused != fused) or not rule.when(config):
            continue
        for i in range(config.num_layers) if "{i}" in rule.hf_name else [None]:
            paths = [t.format(i=i) for t in rule.targets]
            if all(p in flat for p in paths):  # a tied model has no lm_head
                arrays = [np.asarray(flat[p], np.float32) for p in paths]
                out[rule.hf_name.format(i=i)] = np.ascontiguousarray(rule.to_hf(arrays, config))
    return out


def match_rule(name: str, config: ModelConfig) -> tuple[Rule, str | None] | None:
    for rule in RULES:
        m = rule.regex.fullmatch(name) if rule.when(config) else None
        if m:
            return rule, (m.group(1) if m.groups() else None)
    return None


def hf_names_for(target: str, config: ModelConfig) -> str:
    m = re.fullmatch(r"layer_(\d+)/.*", target)
    i = m.group(1) if m else None
    generic = re.sub(r"layer_\d+/", _OURS, target)
    return " or ".join(r.hf_name.format(i=i) for r in RULES if generic in r.targets and r.when(config))
