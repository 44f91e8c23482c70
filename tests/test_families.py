"""The model families beyond LLaMA-2: Llama-3.x RoPE scaling, Qwen2/2.5, Qwen3, Gemma-2 and Gemma-3.

Random tiny transformers models of each family, in several shapes, are saved with `save_pretrained`
(safetensors, sharded safetensors or `pytorch_model.bin`), or written as GGUF files the way
llama.cpp's converter writes them, converted through `tools/convert_hf.py`, and checked against
transformers in float32:
  - logits: max |ours - reference| < 1e-4 * max |reference| (as tests/test_convert.py), over
    sequences longer than the sliding windows. Each case also checks that turning off its family's
    feature (RoPE scaling, biases, q/k norms, soft-capping, Gemma's norms...) breaks that
    tolerance, so the check is not vacuous;
  - plain greedy decoding equals transformers' greedy `generate`, and greedy S3D and
    self-speculative decoding equal plain greedy decoding, on each family;
  - `--to-hf` and back gives the same config and bit-identical params;
  - the mask row, the tokenizer and its chat template come from the source;
  - unsupported config fields are refused with a ConfigError that names them.
"""

from __future__ import annotations

import json
import subprocess
import sys

import jax
import numpy as np
import pytest
from flax.traverse_util import flatten_dict, unflatten_dict
from hf_models import FAMILY_VOCAB, REPO, RTOL, convert_cli, hf_classes, hf_logits, max_abs_diff, random_family_model, relative_error, save
from reference import assert_exact

torch = pytest.importorskip("torch")

import s3d_jax  # noqa: E402
from s3d_jax.checkpoint import Model  # noqa: E402
from s3d_jax.config import ConfigError, ModelConfig  # noqa: E402
from s3d_jax.convert import convert, main  # noqa: E402

LLAMA3_ROPE = dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                   original_max_position_embeddings=64)  # short, so that 16 tokens reach every regime
GEMMA3_ROPE = {"full_attention": dict(rope_type="linear", factor=8.0, rope_theta=1e6),
               "sliding_attention": dict(rope_type="default", rope_theta=10000.0)}

# name: the transformers config (family, how it is saved) and `off`, what turns its feature off:
# config changes, and `drop`, params to remove with them.
CASES = {
    "llama3.1-gqa-tied": dict(
        family="llama", tie_word_embeddings=True, rope_parameters=LLAMA3_ROPE, off=dict(rope_scaling=None)),
    "llama-linear-mha-untied-bin": dict(
        family="llama", save="bin", num_key_value_heads=4, rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
        off=dict(rope_scaling=None)),
    "qwen2-gqa-untied-window": dict(
        family="qwen2", use_sliding_window=True, sliding_window=5, max_window_layers=1, off=dict(sliding_window=None)),
    "qwen2.5-mha-tied": dict(
        family="qwen2", num_key_value_heads=4, tie_word_embeddings=True, off=dict(qkv_bias=False, drop=("q_bias", "k_bias", "v_bias"))),
    "qwen3-gqa-untied-sharded": dict(
        family="qwen3", save="sharded", off=dict(qk_norm=False, drop=("q_norm", "k_norm"))),
    "qwen3-mha-tied-headdim32": dict(
        family="qwen3", num_key_value_heads=4, head_dim=32, tie_word_embeddings=True, off=dict(qk_norm=False, drop=("q_norm", "k_norm"))),
    "gemma2-gqa-tied": dict(
        family="gemma2", sliding_window=5, query_pre_attn_scalar=24, attn_logit_softcapping=4.0, final_logit_softcapping=5.0,
        off=dict(attn_softcap=None)),
    "gemma2-mha-untied-bin": dict(
        family="gemma2", save="bin", num_key_value_heads=4, tie_word_embeddings=False, sliding_window=5,
        final_logit_softcapping=5.0, off=dict(final_softcap=None)),
    "gemma3-gqa-tied": dict(
        family="gemma3_text", sliding_window=5, rope_parameters=GEMMA3_ROPE,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], off=dict(local_rope_theta=None)),
    "gemma3-mha-untied": dict(
        family="gemma3_text", num_key_value_heads=4, tie_word_embeddings=False, sliding_window=5, query_pre_attn_scalar=8,
        off=dict(norm_plus_one=False)),
}
DECODE_CASES = ["llama3.1-gqa-tied", "qwen2-gqa-untied-window", "qwen3-gqa-untied-sharded", "gemma2-gqa-tied", "gemma3-gqa-tied"]
PROMPT_LENGTHS, NEW_TOKENS = (7, 3), 14  # prompt + output run past the windows of 5










def random_ids(n=2, t=16, seed=1):
    return np.random.default_rng(seed).integers(3, FAMILY_VOCAB, (n, t))




def turned_off(model: Model, off: dict) -> Model:
    off = dict(off)
    drop = off.pop("drop", ())
    flat = {k: v for k, v in flatten_dict(model.params).items() if not set(drop) & set(k)}
    return Model(unflatten_dict(flat), model.config.replace(**off), model.tokenizer)


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Case name -> (transformers model, converted model, its directory), built once per case."""
    cache = {}

    def get(case: str):
        if case not in cache:
            spec = {k: v for k, v in CASES[case].items() if k not in ("family", "save", "off")}
            hf_model = random_family_model(CASES[case]["family"], **spec)
            where = tmp_path_factory.mktemp(case.replace(".", "_"))
            save(hf_model, where / "hf", CASES[case].get("save", "safetensors"))
            out = convert_cli(where / "hf", where / "out", subprocess_run=case == "llama3.1-gqa-tied")
            cache[case] = hf_model, s3d_jax.load(out), out
        return cache[case]

    return get


# --------------------------------------------------------------------------------------------
# Logits.


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, converted):
    hf_model, model, _ = converted(case)
    c = model.config
    assert c.architecture == CASES[case]["family"]
    # No tokenizer: an appended row, then padding to a multiple of 128 rows that is never produced.
    assert (c.vocab_size, c.mask_token_id, c.output_vocab_size) == (256, FAMILY_VOCAB, FAMILY_VOCAB)
    ids = random_ids()
    diff, rel = max_abs_diff(model, hf_model, ids)
    print(f"\nPARITY {case}: max abs logit difference {diff:.2e}, relative {rel:.2e} (tolerance {RTOL:.0e})")
    assert rel < RTOL
    _, off_rel = max_abs_diff(turned_off(model, CASES[case]["off"]), hf_model, ids)
    assert off_rel > 100 * RTOL, f"{case}: the feature under test barely changes the logits ({off_rel:.1e})"


def test_family_options_recorded(converted):
    c = converted("qwen2-gqa-untied-window")[1].config
    assert c.qkv_bias and not c.qk_norm and c.sliding_window == 5
    assert c.layer_types == ("full_attention", "sliding_attention", "sliding_attention")
    assert [c.is_sliding(i) for i in c.all_layers] == [False, True, True]
    c = converted("gemma3-gqa-tied")[1].config
    assert (c.hidden_act, c.norm_plus_one, c.post_norms, c.scale_embeddings, c.qk_norm) == ("gelu_pytorch_tanh", True, True, True, True)
    assert [c.layer_rope(i)[0] for i in c.all_layers] == [10000.0, 10000.0, 1e6]
    assert c.rope_scaling.rope_type == "linear" and c.layer_rope(0)[1] is None
    c = converted("llama3.1-gqa-tied")[1].config
    assert (c.rope_scaling.rope_type, c.rope_scaling.factor, c.rope_scaling.original_max_position_embeddings) == ("llama3", 8.0, 64)
    assert ModelConfig.from_json(c.to_json()) == c


# --------------------------------------------------------------------------------------------
# Decoding.


def prompts():
    rng = np.random.default_rng(7)
    return [rng.integers(3, FAMILY_VOCAB, n).tolist() for n in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def plain(converted):
    cache = {}

    def get(case):
        if case not in cache:
            cache[case] = s3d_jax.decode(converted(case)[1], prompts(), method="ar", max_new_tokens=NEW_TOKENS, eos_token_ids=())
        return cache[case]

    return get


@pytest.mark.parametrize("case", DECODE_CASES)
def test_plain_greedy_equals_transformers_generate(case, converted, plain):
    hf_model = converted(case)[0]
    hf_model.generation_config.eos_token_id = None  # run the full length, as eos_token_ids=() does here
    for prompt, ours in zip(prompts(), plain(case).tokens):
        with torch.no_grad():
            out = hf_model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)
        assert ours == out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case", DECODE_CASES)
@pytest.mark.parametrize("method", ["s3d", "selfspec"])
def test_speculative_equals_plain_greedy(case, method, converted, plain):
    assert_exact(converted(case)[1], prompts(), plain=plain(case), method=method, gamma=3, skip=(1, 1), max_new_tokens=NEW_TOKENS,
                 eos_token_ids=())


# --------------------------------------------------------------------------------------------
# Export (`--to-hf`) and back.


@pytest.mark.parametrize("case", list(CASES))
def test_to_hf_round_trip(case, converted, tmp_path):
    from transformers import AutoModelForCausalLM

    hf_model, model, out = converted(case)
    assert main([str(out), str(tmp_path / "back"), "--to-hf"]) == 0
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "back", dtype=torch.float32).eval()
    assert type(exported).__name__ == type(hf_model).__name__
    ids = random_ids(seed=3)
    ref = hf_logits(exported, ids)  # the export keeps the mask row and drops the padding
    assert ref.shape[-1] == FAMILY_VOCAB + 1
    assert relative_error(np.asarray(s3d_jax.logits(model, ids)), ref[..., :FAMILY_VOCAB]) < RTOL
    again = s3d_jax.load(convert(tmp_path / "back", tmp_path / "again", progress=False))
    assert again.config == model.config
    for a, b in zip(jax.tree.leaves(again.params), jax.tree.leaves(model.params), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


# --------------------------------------------------------------------------------------------
# GGUF, written as llama.cpp's convert_hf_to_gguf.py writes each architecture: tensor names from
# gguf-py's own name map, q/k rows unpermuted (these architectures use rotate-half RoPE in
# llama.cpp), Gemma's norm weights stored as 1 + w, and no lm_head for a tied model.

GGUF_CASES = {
    "qwen2": dict(family="qwen2", arch="qwen2"),
    "qwen3": dict(family="qwen3", arch="qwen3", tie_word_embeddings=True),
    "gemma2": dict(family="gemma2", arch="gemma2", tie_word_embeddings=True, sliding_window=5, query_pre_attn_scalar=16,
                   attn_logit_softcapping=4.0, final_logit_softcapping=5.0),
    # Six layers: llama.cpp fixes Gemma-3's pattern at five sliding layers, then a global one.
    "gemma3": dict(family="gemma3_text", arch="gemma3", num_hidden_layers=6, hidden_size=32, num_attention_heads=2,
                   num_key_value_heads=1, sliding_window=5, query_pre_attn_scalar=16,
                   rope_parameters=GEMMA3_ROPE),
}


def gguf_blocks(w: np.ndarray, kind: str) -> np.ndarray:
    """`w` in GGML blocks of `kind`: gguf's own quantization, or for a K-quant (which gguf cannot
    quantize) random codes and sub-block scales with float16 factors of w's magnitude."""
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    if not kind.endswith("_K"):
        return gguf.quants.quantize(np.ascontiguousarray(w), qtype)
    block_size, block_bytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = int(np.prod(w.shape[:-1])), w.shape[-1] // block_size
    rng = np.random.default_rng(w.size)
    data = rng.integers(0, 256, (rows, blocks, block_bytes), dtype=np.uint8)
    factor = np.float16(np.abs(w).max() / (31 * 63 if kind == "Q6_K" else 15 * 63))
    for at in (208,) if kind == "Q6_K" else (0, 2):  # Q6_K's d is last; Q4_K's and Q5_K's d and dmin first
        data[..., at : at + 2] = np.frombuffer(factor.tobytes(), np.uint8)
    return data.reshape(*w.shape[:-1], blocks * block_bytes)


def write_gguf(model, path, arch: str, block_type=lambda name, w: None):
    """`block_type(gguf name, weight)` names a GGML block type (e.g. "Q4_1") to store a tensor in; None keeps float32."""
    import gguf

    c = model.config
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.head_dim)
    writer.add_value_length(c.head_dim)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_vocab_size(c.vocab_size)
    writer.add_eos_token_id(2)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    writer.add_rope_freq_base(rope["rope_theta"])
    if rope["rope_type"] == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(rope["factor"])
    if arch.startswith("gemma"):
        writer.add_sliding_window(c.sliding_window)
    if arch == "gemma2":
        writer.add_attn_logit_softcapping(c.attn_logit_softcapping)
        writer.add_final_logit_softcapping(c.final_logit_softcapping)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[arch.upper()], c.num_hidden_layers)
    for name, w in model.state_dict().items():
        if name == "lm_head.weight" and c.tie_word_embeddings:
            continue
        w = w.float().numpy()
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            w = w + 1
        gguf_name = names.get_name(name, try_suffixes=(".weight", ".bias"))
        kind = block_type(gguf_name, w)
        if kind is None:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
        else:
            writer.add_tensor(gguf_name, gguf_blocks(w, kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.filterwarnings("ignore:no tokenizer")
@pytest.mark.parametrize("case", list(GGUF_CASES))
def test_gguf_logits_match_transformers(case, tmp_path):
    spec = dict(GGUF_CASES[case])
    family, arch = spec.pop("family"), spec.pop("arch")
    hf_model = random_family_model(family, **spec)
    write_gguf(hf_model, tmp_path / f"{case}.gguf", arch)
    model = s3d_jax.load(convert_cli(tmp_path / f"{case}.gguf", tmp_path / "out"))
    assert model.config.architecture == family and model.config.tie_embeddings == hf_model.config.tie_word_embeddings
    diff, rel = max_abs_diff(model, hf_model, random_ids())
    print(f"\nPARITY gguf {case}: max abs logit difference {diff:.2e}, relative {rel:.2e}")
    assert rel < RTOL


def test_gguf_llama3_rope_factors_refused(tmp_path):
    import gguf

    writer = gguf.GGUFWriter(str(tmp_path / "l3.gguf"), "llama")
    writer.add_block_count(1)
    writer.add_tensor("rope_freqs.weight", np.ones(4, np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ConfigError, match="rope_freqs"):
        convert(tmp_path / "l3.gguf", tmp_path / "out", progress=False)


# --------------------------------------------------------------------------------------------
# The mask row, the tokenizer and the chat template.

TEMPLATES = {  # the shape of each family's chat template, on a small word-level vocabulary
    "gemma": "{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
             "{{ m['content'] }}<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}",
    "qwen": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
}


def gemma_tokenizer():
    """A word-level tokenizer with Gemma's special tokens, `<unused0>` among them."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>", "<unused0>", "<unused1>"]
    vocab = {w: i for i, w in enumerate(specials + [f"w{i}" for i in range(90)] + ["user", "model", "hi"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                                        additional_special_tokens=specials[3:])
    tokenizer.chat_template = TEMPLATES["gemma"]
    return tokenizer


def qwen_tokenizer():
    """A byte-level BPE Qwen2Tokenizer over single characters (AutoTokenizer loads a qwen2 directory's
    tokenizer as one)."""
    from transformers import Qwen2Tokenizer
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    chars = list(bytes_to_unicode().values())[:94] + ["Ġ", "Ċ"]  # printable ASCII, space and newline
    tokenizer = Qwen2Tokenizer(vocab={c: i for i, c in enumerate(chars)}, merges=[], unk_token=None, bos_token=None,
                               eos_token="<|im_end|>", pad_token="<|endoftext|>")
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.chat_template = TEMPLATES["qwen"]
    return tokenizer


@pytest.mark.parametrize("family", ["gemma2", "qwen2"])
def test_mask_row_tokenizer_and_chat_template(family, tmp_path):
    if family == "gemma2":  # Gemma: no padding rows, but <unused0>, which the model never produces
        tokenizer = gemma_tokenizer()
        vocab = len(tokenizer)
    else:  # Qwen: the embedding is padded past the tokenizer
        tokenizer = qwen_tokenizer()
        vocab = len(tokenizer) + 6
    hf_model = random_family_model(family, vocab_size=vocab, tie_word_embeddings=True)
    hf_model.save_pretrained(tmp_path / "hf")
    tokenizer.save_pretrained(tmp_path / "hf")

    model = s3d_jax.load(convert_cli(tmp_path / "hf", tmp_path / "out"))
    expected_mask = tokenizer.convert_tokens_to_ids("<unused0>") if family == "gemma2" else vocab - 1
    assert model.config.mask_token_id == expected_mask
    assert (model.config.vocab_size, model.config.produced_vocab_size) == (-(-vocab // 128) * 128, vocab)
    messages = [{"role": "user", "content": "hi w5 w7"}]
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    assert model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"] == ids
    chat = s3d_jax.decode(model, messages, method="ar", max_new_tokens=6, eos_token_ids=())  # `chat=True` for a string
    assert chat.tokens == s3d_jax.decode(model, ids, method="ar", max_new_tokens=6, eos_token_ids=()).tokens
    assert s3d_jax.decode(model, "hi w5 w7", chat=True, method="ar", max_new_tokens=6, eos_token_ids=()).tokens == chat.tokens
    assert model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False).endswith(
        "<start_of_turn>model\n" if family == "gemma2" else "<|im_start|>assistant\n")


# --------------------------------------------------------------------------------------------
# Bad input: each is refused with a ConfigError that names it.


def hf_config(family: str, **fields) -> dict:
    config_cls, _ = hf_classes(family)
    return {**config_cls(hidden_size=64, num_attention_heads=4, num_hidden_layers=2).to_dict(), **fields}


@pytest.mark.parametrize(
    "family, fields, match",
    [
        ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), "rope_scaling type 'dynamic'"),
        ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=2.0)), "rope_scaling type 'yarn'"),
        ("llama", dict(rope_parameters=None, rope_theta=1e4, rope_scaling=dict(type="longrope", factor=2.0)), "'longrope'"),
        ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0)), "lacks the field low_freq_factor"),
        ("qwen3", dict(attention_bias=True), "attention_bias"),
        ("qwen2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
        ("gemma2", dict(hidden_activation="gelu"), "hidden_activation='gelu'"),
        ("gemma3_text", dict(use_bidirectional_attention=True), "use_bidirectional_attention"),
        ("gemma3_text", dict(layer_types=["chunked_attention", "full_attention"]), "layer_types entry 'chunked_attention'"),
        ("gemma3_text", dict(rope_parameters={"full_attention": dict(rope_type="default", rope_theta=1e6),
                                              "sliding_attention": dict(rope_type="linear", rope_theta=1e4, factor=2.0)}),
         "sliding_attention type 'linear'"),
        ("gemma3_text", dict(model_type="gemma3"), "model_type='gemma3'.*gemma3_text"),
    ],
)
def test_unsupported_config_refused(family, fields, match):
    with pytest.raises(ConfigError, match=match):
        ModelConfig.from_hf(hf_config(family, **fields))


def test_unsupported_rope_scaling_refused_by_the_cli(converted, tmp_path):
    _, _, out = converted("llama3.1-gqa-tied")
    assert main([str(out), str(tmp_path / "hf"), "--to-hf"]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    config["rope_parameters"]["rope_type"] = "dynamic"
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))
    result = subprocess.run([sys.executable, str(REPO / "tools" / "convert_hf.py"), str(tmp_path / "hf"), str(tmp_path / "out")],
                            capture_output=True, text=True)
    assert result.returncode == 2 and "rope_scaling type 'dynamic'" in result.stderr and "Traceback" not in result.stderr


def test_legacy_config_layouts():
    """Hub configs written before transformers 5 keep RoPE in `rope_theta`/`rope_scaling` and leave out
    `layer_types`; they give the same config as transformers 5's layout."""
    llama31 = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   rope_theta=500000.0, rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                                                         original_max_position_embeddings=8192), max_position_embeddings=131072)
    v5 = {k: v for k, v in llama31.items() if k not in ("rope_theta", "rope_scaling")}
    v5["rope_parameters"] = dict(llama31["rope_scaling"], rope_theta=500000.0)
    assert ModelConfig.from_hf(llama31) == ModelConfig.from_hf(v5)
    assert ModelConfig.from_hf(llama31).rope_scaling.original_max_position_embeddings == 8192
    gemma3_1b = dict(model_type="gemma3_text", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=7,
                     num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6, rope_local_base_freq=10000.0,
                     rope_scaling=dict(rope_type="linear", factor=8.0), sliding_window=512, sliding_window_pattern=6,
                     query_pre_attn_scalar=16)
    c = ModelConfig.from_hf(gemma3_1b)
    assert c.layer_types == ("sliding_attention",) * 5 + ("full_attention", "sliding_attention")
    assert c.layer_rope(5) == (1e6, c.rope_scaling) and c.layer_rope(0) == (10000.0, None) and c.rope_scaling.factor == 8.0
    assert c.tie_embeddings and c.rms_norm_eps == 1e-6
    qwen25 = dict(model_type="qwen2", vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                  rope_theta=1e6, rope_scaling=None, use_sliding_window=False, sliding_window=131072, max_window_layers=2)
    c = ModelConfig.from_hf(qwen25)
    assert c.sliding_window is None and c.layer_types is None and c.qkv_bias and not c.tie_embeddings
