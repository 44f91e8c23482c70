"""Conversion refuses what the model cannot run, each case with an error that names the problem:
unknown architectures and config fields, missing, truncated, misshapen or extra tensors, corrupt
GGUF files, stale formats, and the command line's exit code."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hf_models import REPO, random_hf_model  # skips this file where torch is not installed
from reference import one_tensor_gguf

import s3d_jax
from s3d_jax import bundled, checkpoint
from s3d_jax.checkpoint import CheckpointError
from s3d_jax.config import ConfigError, ModelConfig
from s3d_jax.convert import convert, main, readers
from s3d_jax.convert.gguf_file import read_header

# --------------------------------------------------------------------------------------------
# Bad inputs: each names the problem.


@pytest.fixture(scope="module")
def tiny_hf_dir(tmp_path_factory):
    where = tmp_path_factory.mktemp("tiny") / "hf"
    random_hf_model("llama", heads=4, kv_heads=2).save_pretrained(where)
    return where


@pytest.fixture
def hf_copy(tiny_hf_dir, tmp_path):
    return Path(shutil.copytree(tiny_hf_dir, tmp_path / "hf"))


def edit_config(where: Path, **changes):
    config = json.loads((where / "config.json").read_text())
    config.update(changes)
    (where / "config.json").write_text(json.dumps(config))


def edit_tensors(where: Path, edit):
    from safetensors.numpy import load_file, save_file

    tensors = load_file(where / "model.safetensors")
    edit(tensors)
    save_file(tensors, where / "model.safetensors", metadata={"format": "pt"})


def test_unknown_architecture(hf_copy, tmp_path):
    edit_config(hf_copy, model_type="gpt2")
    with pytest.raises(ConfigError, match="gpt2"):
        convert(hf_copy, tmp_path / "out", progress=False)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(rope_scaling={"rope_type": "yarn", "factor": 8.0}), "rope_scaling.*yarn"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_unsupported_config_field(hf_copy, tmp_path, changes, match):
    edit_config(hf_copy, **changes)
    with pytest.raises(ConfigError, match=match):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_rope_parameters_from_transformers5():
    """transformers 5 configs keep rope theta and type in `rope_parameters`."""
    from transformers import LlamaConfig, Phi3Config

    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, rope_theta=12345.0).to_dict()
    assert "rope_parameters" in hf and ModelConfig.from_hf(hf).rope_theta == 12345.0
    hf = Phi3Config(hidden_size=64, num_attention_heads=4, rope_theta=5e4).to_dict()
    assert ModelConfig.from_hf(hf).rope_theta == 5e4
    hf = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
                         "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
    ).to_dict()
    assert ModelConfig.from_hf(hf).rope_scaling.rope_type == "llama3"  # Llama-3.1 (tests/test_families.py)
    hf["rope_parameters"].update(rope_type="dynamic")
    with pytest.raises(ConfigError, match="dynamic"):
        ModelConfig.from_hf(hf)
    hf = Phi3Config(hidden_size=64, num_attention_heads=4, partial_rotary_factor=0.5).to_dict()
    with pytest.raises(ConfigError, match="partial_rotary_factor"):
        ModelConfig.from_hf(hf)


def test_missing_weight_file(hf_copy, tmp_path):
    (hf_copy / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no weights in .*model.safetensors"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_missing_config(hf_copy, tmp_path):
    (hf_copy / "config.json").unlink()
    with pytest.raises(CheckpointError, match="config.json is missing"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_missing_source(tmp_path):
    with pytest.raises(CheckpointError, match="no model at"):
        convert(tmp_path / "nowhere", tmp_path / "out", progress=False)


def test_truncated_safetensors(hf_copy, tmp_path):
    path = hf_copy / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])
    with pytest.raises(CheckpointError, match="model.safetensors"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_missing_shard(tmp_path):
    random_hf_model("llama").save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    shard = sorted((tmp_path / "hf").glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(CheckpointError, match=shard.name):
        convert(tmp_path / "hf", tmp_path / "out", progress=False)


def test_wrong_shape(hf_copy, tmp_path):
    name = "model.layers.1.mlp.up_proj.weight"
    edit_tensors(hf_copy, lambda t: t.update({name: t[name][:, :-1].copy()}))
    with pytest.raises(CheckpointError, match=rf"{name} has shape \(96, 63\).*\(96, 64\)"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_missing_tensor(hf_copy, tmp_path):
    edit_tensors(hf_copy, lambda t: t.pop("model.layers.1.self_attn.k_proj.weight"))
    with pytest.raises(CheckpointError, match=r"missing weight model\.layers\.1\.self_attn\.k_proj\.weight"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_unexpected_tensor(hf_copy, tmp_path):
    name = "model.layers.0.self_attn.q_proj.bias"
    edit_tensors(hf_copy, lambda t: t.update({name: np.zeros(64, np.float32)}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {name}"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_extra_layer(hf_copy, tmp_path):
    name = "model.layers.2.input_layernorm.weight"
    edit_tensors(hf_copy, lambda t: t.update({name: np.ones(64, np.float32)}))
    with pytest.raises(CheckpointError, match=rf"unexpected tensor {name}.*2 layers"):
        convert(hf_copy, tmp_path / "out", progress=False)


def test_a_layer_that_cannot_be_read_midway_stops_the_conversion_and_leaves_nothing(hf_copy, tmp_path, monkeypatch):
    """The layers are read as they are written (`checkpoint.LayerStack`): a read that fails on the last
    layer, after the others were written, raises the source's own error, and no output is left."""
    real = readers.LazyTensors.__getitem__

    def damaged(tensors, name):
        if name.startswith("model.layers.1."):
            raise CheckpointError(f"cannot read tensor {name}: damaged")
        return real(tensors, name)

    monkeypatch.setattr(readers.LazyTensors, "__getitem__", damaged)
    with pytest.raises(CheckpointError, match=r"cannot read tensor model\.layers\.1\..*: damaged"):
        convert(hf_copy, tmp_path / "out", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob("out.*"))


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(np.random.default_rng(0).bytes(4096))
    with pytest.raises(CheckpointError, match="bad.gguf"):
        convert(bad, tmp_path / "out", progress=False)


def sample_gguf(path: Path) -> bytes:
    """A small llama GGUF with each kind of header field: scalar, string and array metadata, an explicit
    alignment, and four tensors (two with names of equal length)."""
    import gguf

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_uint32("general.alignment", 32)
    writer.add_array("test.words", ["one", "two"])
    writer.add_uint32("test.other", 1)
    writer.add_tensor("token_embd.weight", np.ones((4, 32), np.float32))
    writer.add_tensor("output.weight", np.ones((4, 32), np.float32))
    writer.add_tensor("blk.0.attn_q.weight", np.ones((32, 32), np.float32))
    writer.add_tensor("blk.0.attn_k.weight", np.ones((32, 32), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def after(name: bytes, skip: int = 0):
    """The position `skip` bytes past the string `name` (its 8-byte length precedes it)."""
    return lambda data: data.index(name) + len(name) + skip


def before(name: bytes):
    return lambda data: data.index(name) - 8


U64_MAX = b"\xff" * 8
# (the field, where it lies, the bytes written there, a fragment of the error)
GGUF_CORRUPTIONS = [
    ("tensor count", lambda d: 8, U64_MAX, "the tensor count is 18446744073709551615, more than"),
    ("metadata count", lambda d: 16, U64_MAX, "the metadata count is 18446744073709551615, more than"),
    ("version", lambda d: 4, (7).to_bytes(4, "little"), "the version is 7"),
    ("key length", before(b"general.architecture"), U64_MAX, "metadata key 0's length is"),
    ("value type", after(b"general.architecture"), (99).to_bytes(4, "little"), "has the unknown value type 99"),
    ("string length", after(b"general.architecture", 4), U64_MAX, "metadata 'general.architecture''s length is"),
    ("array item type", after(b"test.words", 4), (77).to_bytes(4, "little"), "is an array of the unknown value type 77"),
    ("array length", after(b"test.words", 8), U64_MAX, "metadata 'test.words''s array length is"),
    ("array item length", after(b"test.words", 16), U64_MAX, "metadata 'test.words'[0]'s length is"),
    ("string not UTF-8", after(b"test.words", 24), b"\xff", "metadata 'test.words'[0] is not UTF-8 (invalid start byte at byte "),
    ("key given twice", lambda d: d.index(b"test.other"), b"test.words", "metadata 'test.words' is given twice"),
    ("alignment", after(b"general.alignment", 4), (3).to_bytes(4, "little"), "metadata 'general.alignment' is 3, not a power of two"),
    ("tensor name length", before(b"token_embd.weight"), U64_MAX, "tensor 0 name's length is"),
    ("dimension count", after(b"token_embd.weight"), (9).to_bytes(4, "little"), "dimension count is 9, not 1 to 4"),
    ("dimension", after(b"token_embd.weight", 4), U64_MAX, "'token_embd.weight')'s shape is [18446744073709551615, 4]"),
    ("tensor type", after(b"token_embd.weight", 20), (999).to_bytes(4, "little"), "is the unknown tensor type 999"),
    ("misaligned offset", after(b"output.weight", 24), (1).to_bytes(8, "little"), "offset is 1, not a multiple of the alignment 32"),
    ("overlapping offset", after(b"output.weight", 24), (0).to_bytes(8, "little"), "offset is 0, inside the data of tensor 0"),
    ("offset past the end", after(b"output.weight", 24), (1 << 40).to_bytes(8, "little"), "offset is 1099511627776, past the end"),
    ("tensor given twice", lambda d: d.index(b"blk.0.attn_k.weight"), b"blk.0.attn_q.weight",
     "tensor 3 ('blk.0.attn_q.weight') is given twice"),
]


@pytest.mark.parametrize(("field", "where", "raw", "words"), GGUF_CORRUPTIONS, ids=[c[0] for c in GGUF_CORRUPTIONS])
def test_a_gguf_header_that_lies_is_named_before_it_is_used(tmp_path, field, where, raw, words):
    data = bytearray(sample_gguf(tmp_path / "good.gguf"))
    at = where(bytes(data))
    data[at : at + len(raw)] = raw
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="bad.gguf has a corrupt GGUF header: ") as caught:
        convert(bad, tmp_path / "out", progress=False)
    assert words in str(caught.value), str(caught.value)


def test_a_lying_tensor_count_on_the_command_line_is_one_clear_error(tmp_path, capsys):
    data = bytearray(sample_gguf(tmp_path / "good.gguf"))
    data[8:16] = U64_MAX
    (tmp_path / "bad.gguf").write_bytes(bytes(data))
    assert main([str(tmp_path / "bad.gguf"), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "the tensor count is 18446744073709551615" in err and "Traceback" not in err


@pytest.mark.parametrize("which", ["sample", pytest.param("bundled", marks=pytest.mark.needs("bundled_model"))])
def test_the_header_reads_as_the_gguf_package_reads_it(which, tmp_path):
    """Every metadata value (the bundled model's 49k-token vocabulary and merges included) and every
    tensor's type, shape and data, as gguf's own reader gives them."""
    import gguf

    if which == "sample":
        sample_gguf(path := tmp_path / "good.gguf")
    else:
        path = bundled.gguf_path()
    header, reader = read_header(path), gguf.GGUFReader(str(path))
    assert header.metadata == {key: f.contents() for key, f in reader.fields.items() if not key.startswith("GGUF.")}
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for t in reader.tensors:
        ours = header.tensors[t.name]
        assert (ours.tensor_type, ours.shape, ours.data_offset) == (t.tensor_type, tuple(t.shape.tolist()), t.data_offset)
        assert (ours.array_shape, ours.array_dtype) == (t.data.shape, t.data.dtype)


def test_non_llama_gguf(tmp_path):
    path = one_tensor_gguf(tmp_path / "gpt2.gguf", "gpt2", np.zeros((4, 8), np.float32))
    with pytest.raises(ConfigError, match="GGUF architecture 'gpt2'"):
        convert(path, tmp_path / "out", progress=False)


def test_edited_layer_count_fails_to_load(tiny_hf_dir, tmp_path):
    out = convert(tiny_hf_dir, tmp_path / "out", progress=False)
    config = json.loads((out / "s3d_config.json").read_text())
    config["num_layers"] = 3
    (out / "s3d_config.json").write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match=r"\['layers'\].* has shape \(2, .*, the config implies \(3, "):
        checkpoint.load(out)


def test_older_format_asks_for_a_new_conversion(tiny_hf_dir, tmp_path):
    out = convert(tiny_hf_dir, tmp_path / "out", progress=False)
    config = json.loads((out / "s3d_config.json").read_text())
    assert config.pop("format") == checkpoint.FORMAT
    (out / "s3d_config.json").write_text(json.dumps(config))  # as format 1 wrote it
    expected = f"holds model format 1, and this s3d_jax reads formats 4 to {checkpoint.FORMAT}: convert the model again"
    with pytest.raises(CheckpointError, match=expected):
        s3d_jax.load(out)
    (out / "s3d_config.json").write_text(json.dumps({"format": 4, **config}))  # format 4 had no weight_formats: still read
    assert s3d_jax.load(out).config.weight_formats == ()


def test_cli_error_exits_2(tmp_path, capsys):
    assert main([str(tmp_path / "nowhere"), str(tmp_path / "out"), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no model at") and "Traceback" not in err


def test_cli_error_subprocess(hf_copy, tmp_path):
    edit_config(hf_copy, model_type="gpt2")
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "convert_hf.py"), str(hf_copy), str(tmp_path / "out")],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert result.stderr.startswith("error: unknown architecture model_type='gpt2'")
    assert "Traceback" not in result.stderr


