"""Hostile input to the API, the generate command line and config/checkpoint loading: each bad
input gets a clear error from this project (naming the field and the value) before any work starts,
never a hang, a library traceback or silently wrong output."""

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from reference import tiny_config, tiny_model

import s3d_jax
from s3d_jax import bundled, checkpoint, compile_cache, generate
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ConfigError, ModelConfig

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@contextlib.contextmanager
def time_limit(seconds: int):
    """Fails a test that would hang instead of letting it run forever."""

    def expire(signum, frame):
        raise TimeoutError(f"still running after {seconds}s: a hang")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


class NoTokenizer:
    """Stands in for a tokenizer where the input must be refused before any tokenizer call."""

    eos_token_id = None

    def __getattr__(self, name):
        raise AssertionError(f"the tokenizer was called ({name}) before the input was checked")

    def __call__(self, *args, **kwargs):
        raise AssertionError("the tokenizer was called before the input was checked")


# ------------------------------------------------------------------ decode: the table

DECODE_CASES = [
    # (prompt, keyword overrides, exception, message fragment)
    ([1, 2], dict(temperature=float("nan")), ValueError, r"temperature must be finite, got nan"),
    ([1, 2], dict(temperature=float("inf")), ValueError, r"temperature must be finite, got inf"),
    ([1, 2], dict(temperature=-0.5), ValueError, r"temperature must be >= 0"),
    ([1, 2], dict(temperature=1e300), ValueError, r"temperature must be at most 3.40282e\+38, the largest float32, got 1e\+300"),
    ([1, 2], dict(temperature="0.7"), TypeError, r"temperature must be a number, got '0.7'"),
    ([1, 2], dict(top_p=float("nan")), ValueError, r"top_p must be finite"),
    ([1, 2], dict(top_p=1.5), ValueError, r"top_p must be in \(0, 1\]"),
    ([1, 2], dict(top_k=2.5), TypeError, r"top_k must be an int, got 2.5"),
    ([1, 2], dict(top_k=-1), ValueError, r"top_k must be >= 0"),
    ([1, 2], dict(top_k=1000), ValueError, r"top_k 1000 exceeds the vocabulary of 96"),
    ([1, 2], dict(max_new_tokens="8"), TypeError, r"max_new_tokens must be an int, got '8'"),
    ([1, 2], dict(max_new_tokens=2.5), TypeError, r"max_new_tokens must be an int, got 2.5"),
    ([1, 2], dict(max_new_tokens=True), TypeError, r"max_new_tokens must be an int, got True"),
    ([1, 2], dict(max_new_tokens=0), ValueError, r"max_new_tokens must be >= 1, got 0"),
    ([1, 2], dict(gamma=2.7), TypeError, r"gamma must be an int, got 2.7"),
    ([1, 2], dict(gamma=0), ValueError, r"gamma must be >= 1, got 0"),
    ([1, 2], dict(gamma=600), ValueError, r"gamma 600 \(the draft block\) .* does not fit the cache"),
    ([1, 2], dict(seed=2**70), ValueError, r"seed must be < 2\*\*32"),
    ([1, 2], dict(seed=2**32), ValueError, r"seed must be < 2\*\*32"),
    ([1, 2], dict(seed=-1), ValueError, r"seed must be >= 0, got -1"),
    ([1, 2], dict(seed=1.0), TypeError, r"seed must be an int, got 1.0"),
    ([1, 2], dict(skip=(1.5, 3)), TypeError, r"skip must be an int, got 1.5"),
    ([1, 2], dict(skip="12"), TypeError, r"skip must be a pair of layer indices"),
    ([1, 2], dict(skip=(1,)), TypeError, r"skip must be a pair of layer indices"),
    ([1, 2], dict(skip=(3, 9)), ConfigError, r"skip range \[3, 9\] is outside the model's layers 0..5"),
    ([1, 2], dict(chat="yes"), TypeError, r"chat must be True or False, got 'yes'"),
    ([1, 2], dict(eos_token_ids=2), TypeError, r"eos_token_ids must be a sequence of token ids, got 2"),
    ([1, 2], dict(eos_token_ids=[2.0]), TypeError, r"eos_token_ids must be an int, got 2.0"),
    ([1, 2], dict(eos_token_ids=[500]), ValueError, r"eos token id 500 is outside the vocabulary of 96"),
    ([1, 2], dict(eos_token_ids=[95]), ValueError, r"eos token id 95 is the mask token"),
    ([1, 2], dict(max_len=0), ValueError, r"max_len must be >= 1, got 0"),
    ([1, 2], dict(max_len=10**12), ValueError, r"max_len 1000000000000 exceeds the model's context of 512 positions"),
    ([1, 2], dict(method=None), ValueError, r"unknown method None"),
    ([1, 2], dict(beam_width=4), TypeError, r"unknown decode option 'beam_width'"),
    ([1.7, 2.9], {}, TypeError, r"token ids must be ints, got 1.7"),
    ([[1, 2], [3.5, 4]], {}, TypeError, r"token ids must be ints, got 3.5"),
    ([True, 2], {}, TypeError, r"token ids must be ints, got True"),
    (np.array([1.0, 2.0]), {}, TypeError, r"token ids must be ints, got an array of float64"),
    ([1, 2**70], {}, ValueError, r"token id 1180591620717411303424 is outside the vocabulary"),
    ([1, 95], {}, ValueError, r"token id 95 is the mask token, which only the draft's input may hold"),
    ([1, [2, 3]], {}, ValueError, r"ragged row"),
    ([[[1, 2], [3, 4]]], {}, ValueError, r"each prompt must be a flat list of token ids"),
    (np.zeros((0, 3), np.int32), {}, ValueError, r"empty batch: give at least one prompt"),
    ([[1, 2], []], {}, ValueError, r"empty prompt"),
    ([None], {}, TypeError, r"token ids must be ints, got None"),
    ({"role": "user", "content": "hi"}, {}, TypeError, r"unsupported prompt type dict"),
    (b"hi", {}, TypeError, r"unsupported prompt type bytes"),
    ([1, 2], dict(max_new_tokens=600), ValueError, r"does not fit the cache of 512 positions"),
    ([1, 2], dict(max_new_tokens=100, max_len=64), ValueError, r"does not fit the cache of 64 positions"),
    ([], {}, ValueError, r"empty prompt"),
    ([1, 500], {}, ValueError, r"token id 500 is outside the vocabulary"),
    ([1, -1], {}, ValueError, r"token id -1 is outside the vocabulary"),
    ([1, 2], dict(skip=(0, 5)), ValueError, r"leaves no draft layer"),
    ([1, 2], dict(method="medusa"), ValueError, r"unknown method 'medusa'"),
    ([1, 2], dict(temperature=1.0, top_p=0.0), ValueError, r"top_p must be in \(0, 1\]"),
    ("hello", {}, ValueError, r"no tokenizer"),
    # A token tree's context branch and its gate.
    ([1, 2, 3], dict(gamma=4, lookup=True, tree=0), ValueError, r"give tree=N"),
    ([1, 2, 3], dict(gamma=4, lookup=True, method="ar"), ValueError, r"needs method 's3d'"),
    ([1, 2, 3], dict(gamma=4, lookup="yes", tree=4), TypeError, r"lookup must be True or False"),
    ([1, 2, 3], dict(gamma=4, max_new_tokens=4, tree=58, max_len=64), ValueError, r"tree 58 \+ lookup 4"),
    ([1, 2, 3], dict(gamma=4, min_certainty=0.5), ValueError, r"min_certainty chooses between .* give tree=N"),
]


@pytest.mark.parametrize("prompt,overrides,error,message", DECODE_CASES)
def test_decode_refuses(model, prompt, overrides, error, message):
    with pytest.raises(error, match=message):
        s3d_jax.decode(model, prompt, **overrides)


TEXT_CASES = [
    # Refused before the tokenizer sees them: a lone surrogate, chat messages whose parts are not text.
    ("a\ud800b", {}, ValueError, r"prompt is not valid Unicode: '\\ud800' at index 1"),
    ("a\udcffb", dict(chat=True), ValueError, r"not valid Unicode: '\\udcff'"),
    ([{"role": "user", "content": 5}], {}, TypeError, r"chat message 0 content must be text, got int"),
    ([{"role": "user", "content": None}], {}, TypeError, r"chat message 0 content must be text, got NoneType"),
    ([{"role": "user", "content": "hi"}, {"content": "x"}], {}, TypeError, r"chat message 1 role must be text"),
    ([{"role": "user", "content": "ok \ud800"}], {}, ValueError, r"chat message 0 content is not valid Unicode"),
    ([{"role": "user", "content": "hi"}, "bye"], {}, TypeError, r"chat message 1 must be a dict"),
]


@pytest.mark.parametrize("prompt,overrides,error,message", TEXT_CASES)
def test_text_is_checked_before_the_tokenizer(model, prompt, overrides, error, message):
    with_tokenizer = s3d_jax.Model(model.params, model.config, NoTokenizer())
    with pytest.raises(error, match=message):
        s3d_jax.decode(with_tokenizer, prompt, **overrides)


class ListTokenizer:
    """Text to known ids, so that prompt handling can be checked without a real tokenizer."""

    eos_token_id = None

    def __call__(self, text):
        return {"input_ids": [1, 2, 3]}

    def apply_chat_template(self, messages, add_generation_prompt, tokenize):
        return [7] * len(messages) + [8, 9]


@pytest.mark.parametrize(
    "prompt,overrides,rows",
    [
        ("hi", {}, [[1, 2, 3]]),
        ("hi", dict(chat=True), [[7, 8, 9]]),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}], {}, [[7, 7, 8, 9]]),
        (["hi", [4, 5]], {}, [[1, 2, 3], [4, 5]]),
        (np.array([[4, 5], [6, 7]], np.uint16), {}, [[4, 5], [6, 7]]),
    ],
)
def test_good_prompts_still_reach_the_model(model, prompt, overrides, rows):
    with_tokenizer = s3d_jax.Model(model.params, model.config, ListTokenizer())
    _, run, _ = s3d_jax.api.prepare(with_tokenizer, prompt, **overrides)
    assert [row[:n].tolist() for row, n in zip(run.prompts, run.prompt_lengths)] == rows


def test_plain_options_drop_what_only_s3d_accepts():
    options = s3d_jax.DecodeOptions(tree=4, lookup=True, min_certainty=0.9, max_new_tokens=7, chat=True)
    assert options.plain() == s3d_jax.DecodeOptions(method="ar", max_new_tokens=7, chat=True)


def test_options_accept_numpy_ints_and_normalise_them():
    options = s3d_jax.DecodeOptions(gamma=np.int32(2), max_new_tokens=np.int64(3), skip=[np.int64(1), 2], seed=np.uint8(7),
                                    temperature=1, eos_token_ids=[np.int32(4)])
    assert options.gamma == 2 and type(options.gamma) is int and type(options.max_new_tokens) is int
    assert options.skip == (1, 2) and options.eos_token_ids == (4,) and type(options.temperature) is float


# ------------------------------------------------------------------ the model argument, logits, stream


def test_raw_params_must_match_their_config(model):
    with pytest.raises(CheckpointError, match=r"params: parameter .* has shape .* the config implies"):
        s3d_jax.decode(model.params, [1, 2], config=tiny_config(hidden_size=24))


@pytest.mark.parametrize(
    "params,config,error,message",
    [
        ("params", {"hidden_size": 48}, TypeError, r"config must be a ModelConfig, got dict"),
        ("model", tiny_config(num_layers=4), ConfigError, r"config= is for raw params only"),
        (3, None, ConfigError, r"expected a Model from s3d_jax.load, a path, or None; got int"),
    ],
)
def test_model_argument_is_checked(model, params, config, error, message):
    params = {"params": model.params, "model": model}.get(params, params)
    with pytest.raises(error, match=message):
        s3d_jax.decode(params, [1, 2], config=config)


def test_options_must_be_decode_options(model):
    with pytest.raises(TypeError, match=r"options must be a DecodeOptions, got dict"):
        s3d_jax.decode(model, [1, 2], {"method": "ar"})


@pytest.mark.parametrize(
    "token_ids,error,message",
    [
        ([1.7, 2.9], TypeError, r"token ids must be ints, got 1.7"),
        ([[1, 2], [3]], ValueError, r"ragged row"),
        ([], ValueError, r"empty prompt"),
        ([1, 96], ValueError, r"token id 96 is outside the vocabulary"),
        ([1] * 17, ValueError, r"17 tokens exceed the model's context of 16 positions"),
    ],
)
def test_logits_refuses(token_ids, error, message):
    short = tiny_model(seed=3, max_position_embeddings=16)
    with pytest.raises(error, match=message):
        s3d_jax.logits(short, token_ids)


@pytest.mark.parametrize("chunk,error", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_stream_refuses_a_bad_chunk_instead_of_hanging(model, chunk, error):
    with time_limit(60), pytest.raises(error, match=r"chunk_iterations must be"):
        s3d_jax.stream(model, [1, 2], max_new_tokens=4, chunk_iterations=chunk)  # raises at the call, not lazily


# ------------------------------------------------------------------ config and checkpoint loading

CONFIG_CASES = [
    (dict(hidden_size="64"), r"config field hidden_size must be int, got '64'"),
    (dict(num_layers=True), r"config field num_layers must be int, got True"),
    (dict(vocab_size=96.0), r"config field vocab_size must be int, got 96.0"),
    (dict(tie_embeddings=1), r"config field tie_embeddings must be bool, got 1"),
    (dict(rope_theta="1e4"), r"config field rope_theta must be float, got '1e4'"),
    (dict(rms_norm_eps=0.0), r"config field rms_norm_eps must be a positive finite number, got 0.0"),
    (dict(rms_norm_eps=-1e-6), r"rms_norm_eps must be a positive finite number"),
    (dict(rms_norm_eps=math.nan), r"rms_norm_eps must be a positive finite number, got nan"),
    (dict(rope_theta=0), r"config field rope_theta must be a positive finite number, got 0.0"),
    (dict(max_position_embeddings=0), r"config field max_position_embeddings must be a positive integer, got 0"),
    (dict(sliding_window=0), r"config field sliding_window must be a positive integer"),
    (dict(eos_token_ids=[95]), r"mask_token_id 95 is an EOS id too"),
    (dict(eos_token_ids=[96]), r"eos token id 96 is outside the vocabulary of 96"),
    (dict(eos_token_ids=2), r"config field eos_token_ids must be tuple\[int, ...\], got 2"),
    (dict(draft_skip=[1.5, 3]), r"config field draft_skip must be tuple\[int, int\] or None, got \[1.5, 3\]"),
    (dict(draft_gamma=0), r"config field draft_gamma must be a positive integer, got 0"),
    (dict(mask_token_id=96), r"mask_token_id 96 is outside the vocabulary"),
    (dict(draft_dtype="int8"), r"unsupported draft_dtype 'int8'; supported: float32, bfloat16, float16"),
    (dict(activations="int4"), r"unsupported activations 'int4'; supported: float32, int8"),
]


@pytest.mark.parametrize("overrides,message", CONFIG_CASES)
def test_model_config_refuses(overrides, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(**overrides)


def test_model_config_normalises_numpy_and_json_values():
    config = tiny_config(vocab_size=np.int64(96), rope_theta=10000, eos_token_ids=[np.int32(3)], draft_skip=[1, 2])
    assert type(config.vocab_size) is int and type(config.rope_theta) is float
    assert config.eos_token_ids == (3,) and config.draft_skip == (1, 2)
    assert ModelConfig.from_json(config.to_json()) == config


def _config_json(**changes) -> str:
    fields = {"format": checkpoint.FORMAT, **json.loads(tiny_config().to_json())}
    fields.update(changes)
    return json.dumps(fields)


@pytest.mark.parametrize(
    "text,message",
    [
        (_config_json(hidden_size="64"), r"config field hidden_size must be int, got '64'"),
        (_config_json(tie_embeddings="false"), r"config field tie_embeddings must be bool, got 'false'"),
        (_config_json(rms_norm_eps=0), r"config field rms_norm_eps must be a positive finite number, got 0.0"),
        (_config_json(eos_token_ids=[95]), r"mask_token_id 95 is an EOS id too"),
        (_config_json(num_layers=None), r"config field num_layers must be int, got None"),
        ("{not json", r"config is not valid JSON"),
        ("[1, 2]", r"config must be a JSON object, got list"),
        (f'{{"format": {checkpoint.FORMAT}, "architecture": "llama"}}', r"config fields missing: head_dim, hidden_size"),
    ],
)
def test_loading_a_bad_config_file_is_a_checkpoint_error(tmp_path, text, message):
    (tmp_path / checkpoint.CONFIG_FILE).write_text(text)
    with pytest.raises(CheckpointError, match=r"s3d_config.json is not a valid model config: " + message):
        s3d_jax.load(tmp_path)


def test_load_refuses_an_unknown_dtype_before_reading(tmp_path):
    with pytest.raises(ConfigError, match=r"unsupported dtype 'float64'"):
        s3d_jax.load(tmp_path, dtype="float64")
    with pytest.raises(ValueError, match=r"activations must be one of float32, int8, got 'bfloat16'"):
        s3d_jax.load(tmp_path, activations="bfloat16")


# ------------------------------------------------------------------ the generate command line


@pytest.fixture
def no_compile_cache(monkeypatch):
    """In-process mains must not point this test process's compilation cache at the user's directory."""
    monkeypatch.setattr(compile_cache, "enable", lambda path=None: None)


ARGPARSE_CASES = [  # refused by argparse: exit 2, "error: argument ..." on stderr, before anything loads
    (["--chunk", "0"], r"argument --chunk: must be >= 1, got 0"),
    (["--chunk", "-1"], r"argument --chunk: must be >= 1, got -1"),
    (["--max-new-tokens", "2.5"], r"argument --max-new-tokens: invalid int value: '2.5'"),
    (["--method", "beam"], r"argument --method: invalid choice: 'beam'"),
    (["--activations", "int4"], r"argument --activations: invalid choice: 'int4'"),
]

CLI_CASES = [  # refused by the project: exit 2 and "error: ..." on stderr
    (["--temperature", "nan"], r"error: temperature must be finite, got nan"),
    (["--temperature", "-1"], r"error: temperature must be >= 0"),
    (["--temperature", "1e300"], r"error: temperature must be at most 3.40282e\+38, the largest float32"),
    (["--max-new-tokens", "0"], r"error: max_new_tokens must be >= 1, got 0"),
    (["--top-p", "0"], r"error: top_p must be in \(0, 1\]"),
    (["--seed", "-3"], r"error: seed must be >= 0, got -3"),
    (["--gamma", "0"], r"error: gamma must be >= 1, got 0"),
    (["--model", "/nonexistent/s3d"], r"error: no converted model at /nonexistent/s3d"),
    (["--model", "MODEL", "--skip", "3", "9"], r"error: skip range \[3, 9\] is outside the model's layers"),
    (["--model", "MODEL", "--top-k", "1000", "--temperature", "1"], r"error: top_k 1000 exceeds the vocabulary of 96"),
    (["--model", "MODEL", "--prompt", "bad \udcff byte"], r"error: prompt is not valid Unicode: '\\udcff'"),
    (["--model", "MODEL"], r"error: this model has no tokenizer"),
    (["--tree", "-2"], r"error: tree must be >= 0, got -2"),
    (["--tree", "4", "--method", "ar"], r"error: tree drafting builds on the S3D draft pass: it needs method 's3d', not 'ar'"),
    (["--model", "MODEL", "--tree", "500"], r"error: tree 500 has more nodes than the 95 tokens"),
    (["--lookup", "--method", "selfspec"], r"error: the context branch runs through an S3D token tree's slots: it needs method 's3d'"),
    (["--model", "MODEL", "--lookup", "--tree", "0"], r"error: lookup verifies a context branch .* give tree=N"),
    (["--min-certainty", "1.5"], r"error: min_certainty is a probability: it must be in \[0, 1\], got 1.5"),
    (["--min-certainty", "0.5", "--method", "ar"], r"error: min_certainty chooses between an S3D draft and a plain step"),
    (["--model", "MODEL", "--min-certainty", "0.5", "--tree", "0"],
     r"error: min_certainty chooses between a drafted token tree .* give tree=N"),
    (["--model", "MODEL", "--drafter", "/nonexistent/d.safetensors"], r"error: no drafter file at /nonexistent/d.safetensors"),
    (["--model", "MODEL", "--draft-vocab", "8"], r"error: draft_vocab_size needs a drafter"),
    (["--model", "MODEL", "--drafter", "SHIPPED"], r"error: the drafter .* was made for another model: its vocab_size is 49280"),
]


@pytest.mark.parametrize("argv,message", ARGPARSE_CASES)
def test_generate_cli_flag_errors(argv, message, capsys, no_compile_cache):
    with time_limit(60), pytest.raises(SystemExit) as exit_info:
        generate.main(["--prompt", "hi", "--max-new-tokens", "4", *argv])
    assert exit_info.value.code == 2
    assert "Traceback" not in (err := capsys.readouterr().err)
    assert re.search(message, err), err


@pytest.mark.parametrize("argv,message", CLI_CASES)
def test_generate_cli_errors(argv, message, tiny_model_dir, capsys, no_compile_cache):
    argv = [{"MODEL": str(tiny_model_dir), "SHIPPED": str(bundled.DRAFTER)}.get(a, a) for a in argv]
    if "--prompt" not in argv:
        argv = ["--prompt", "hi", *argv]
    with time_limit(120):
        assert generate.main(argv) == 2
    err = capsys.readouterr().err
    assert re.search(message, err), err


@pytest.mark.parametrize("value", ["maybe", "2", "of"])
def test_generate_cli_names_a_bad_kernel_switch_before_loading(value, capsys, monkeypatch, no_compile_cache):
    monkeypatch.setenv("S3D_JAX_FEW_ROW_KERNEL", value)
    assert generate.main(["--prompt", "hi", "--model", "/nonexistent/s3d"]) == 2  # the switch is named first
    assert f"error: S3D_JAX_FEW_ROW_KERNEL='{value}': expected one of 1, 0, true, false" in capsys.readouterr().err


def test_generate_cli_chunk_0_exits_instead_of_hanging(tmp_path):
    """The issue's command, end to end in its own process (it used to loop forever)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "S3D_JAX_CACHE": str(tmp_path)}
    done = subprocess.run([sys.executable, "-m", "s3d_jax.generate", "--prompt", "hi", "--max-new-tokens", "4", "--chunk", "0"],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2
    assert "argument --chunk: must be >= 1, got 0" in done.stderr


# ------------------------------------------------------------------ what used to be silently wrong, now right


def test_tiny_temperature_is_greedy_not_garbage(model):
    """Logits divided by 1e-30 used to overflow to NaN and sample token 0 or the mask token."""
    options = dict(method="ar", max_new_tokens=8, eos_token_ids=())
    greedy = s3d_jax.decode(model, [4, 5, 6], **options).tokens
    assert s3d_jax.decode(model, [4, 5, 6], temperature=1e-30, seed=1, **options).tokens == greedy


def test_selfspec_with_a_large_gamma_compiles_once_and_equals_greedy(model):
    """The γ one-token draft passes are a loop, not γ unrolled copies: γ = 16 compiles like γ = 2."""
    options = dict(max_new_tokens=24, eos_token_ids=())
    greedy = s3d_jax.decode(model, [4, 5, 6], method="ar", **options).tokens
    out = s3d_jax.decode(model, [4, 5, 6], method="selfspec", gamma=16, skip=(2, 3), **options)
    assert out.tokens == greedy
    assert out.stats.tokens_per_iteration > 1.0  # drafts were accepted, so the loop drafted something


def test_a_cache_path_that_is_a_file_is_named_before_any_work(tmp_path, monkeypatch):
    (tmp_path / "file").write_text("not a directory")
    monkeypatch.setenv("S3D_JAX_CACHE", str(tmp_path / "file"))
    with pytest.raises(ValueError, match=r"S3D_JAX_CACHE=.*file is a file, not a directory"):
        s3d_jax.load()
    result = subprocess.run([sys.executable, "-m", "s3d_jax.generate", "--prompt", "hi"], capture_output=True, text=True,
                            env={**os.environ, "S3D_JAX_CACHE": str(tmp_path / "file")}, timeout=120)
    assert result.returncode == 2 and "is a file, not a directory" in result.stderr and "Traceback" not in result.stderr


def test_padding_rows_are_not_prompt_tokens(model):
    """A converted model's vocabulary is padded past its tokenizer (`output_vocab_size`): ids there are
    rows no token owns, refused with the tokenizer's size."""
    config = model.config.replace(output_vocab_size=90)
    with pytest.raises(ValueError, match=r"token id 92 is outside the vocabulary \[0, 90\)"):
        s3d_jax.decode(model.params, [1, 92], config=config, max_new_tokens=2)
    assert s3d_jax.decode(model.params, [1, 89], config=config, max_new_tokens=2).tokens
