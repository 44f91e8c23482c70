"""The model's own replies as training data: batched generation that resumes after a kill."""

import json

import pytest
from reference import tiny_chat_model

from s3d_jax import bundled, data, self_data
from s3d_jax.options import DecodeOptions

PROMPTS = [(f"p{i}", f"Question number {i}: what is {i} plus {i}?") for i in range(7)]
OPTIONS = DecodeOptions(method="ar", max_new_tokens=6)
pytestmark = pytest.mark.needs("bundled_model")  # its tokenizer and chat template


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replies_resume_after_a_cut_line_with_none_lost_or_repeated(tmp_path, capsys):
    model = tiny_chat_model()
    clean, resumed = tmp_path / "clean.jsonl", tmp_path / "resumed.jsonl"
    self_data.generate(model, PROMPTS, clean, OPTIONS, batch=3, progress=False)
    assert [r["id"] for r in lines(clean)] == [key for key, _ in PROMPTS]

    # A run killed in its second batch: one whole batch written, then half of a line.
    self_data.generate(model, PROMPTS[:3], resumed, OPTIONS, batch=3, progress=False)
    cut = clean.read_text().splitlines()[3]
    with resumed.open("a") as f:
        f.write(cut[: len(cut) // 2])
    report = self_data.generate(model, PROMPTS, resumed, OPTIONS, batch=3, progress=False)
    assert "line 4 was cut off" in capsys.readouterr().err
    assert report["replies"] == 4
    assert lines(resumed) == lines(clean)  # every reply once, in order, the same greedy text

    # The trainer reads the file like any other ShareGPT data.
    records = data.read_records(resumed)
    assert [data.to_messages(r)[1]["role"] for r in records] == ["assistant"] * len(PROMPTS)


def test_batched_replies_equal_replies_one_at_a_time(tmp_path):
    model = tiny_chat_model()
    batched, single = tmp_path / "batched.jsonl", tmp_path / "single.jsonl"
    self_data.generate(model, PROMPTS[:4], batched, OPTIONS, batch=4, progress=False)
    self_data.generate(model, PROMPTS[:4], single, OPTIONS, batch=1, progress=False)
    assert lines(batched) == lines(single)


def test_first_turns_skip_long_prompts_and_keep_file_order(tmp_path):
    path = tmp_path / "convs.jsonl"
    rows = [
        {"id": "a", "conversations": [{"from": "human", "value": "short one"}, {"from": "gpt", "value": "ok"}]},
        {"id": "b", "conversations": [{"from": "human", "value": "word " * 200}, {"from": "gpt", "value": "ok"}]},
        {"id": "c", "conversations": [{"from": "gpt", "value": "no question"}]},
        {"id": "d", "conversations": [{"from": "human", "value": "another"}, {"from": "gpt", "value": "fine"}]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = self_data.first_turns(path, bundled.tokenizer(), max_prompt_tokens=50)
    assert prompts == [("a", "short one"), ("d", "another")]
    # --skip counts usable prompts only, and --limit counts after it.
    assert self_data.first_turns(path, bundled.tokenizer(), max_prompt_tokens=50, skip=1) == [("d", "another")]
    assert self_data.first_turns(path, bundled.tokenizer(), max_prompt_tokens=50, limit=1, skip=1) == [("d", "another")]
    assert self_data.first_turns(path, bundled.tokenizer(), max_prompt_tokens=50, limit=1) == [("a", "short one")]


def test_resume_reads_replies_that_hold_unicode_line_separators(tmp_path):
    out = tmp_path / "replies.jsonl"
    replies = [{"id": "a", "conversations": [], "text": "one\u2028two\x85three\u2029"}, {"id": "b", "conversations": []}]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in replies), encoding="utf-8")
    assert self_data.answered_ids(out) == {"a", "b"}
