"""The model's own replies as training data: batched generation that resumes after a kill."""

import json

import pytest
from reference import tiny_chat_model

from s3d_jax import bundled, data, self_data
from s3d_jax.options import DecodeOptions

PROMPTS = [self_data.Prompt(f"p{i}", 0, ({"role": "user", "content": f"Question number {i}: what is {i} plus {i}?"},)) for i in range(7)]
OPTIONS = DecodeOptions(method="ar", max_new_tokens=6)
pytestmark = pytest.mark.needs("bundled_model")  # its tokenizer and chat template


def lines(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_replies_resume_after_a_cut_line_with_none_lost_or_repeated(tmp_path, capsys):
    model = tiny_chat_model()
    clean, resumed = tmp_path / "clean.jsonl", tmp_path / "resumed.jsonl"
    self_data.generate(model, PROMPTS, clean, OPTIONS, batch=3, progress=False)
    assert [r["id"] for r in lines(clean)] == [prompt.key for prompt in PROMPTS]

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


def conversation(key, *texts):
    roles = ["human", "gpt"]
    return {"id": key, "conversations": [{"from": roles[i % 2], "value": text} for i, text in enumerate(texts)]}


def test_first_turns_skip_long_prompts_and_keep_file_order(tmp_path):
    path = tmp_path / "convs.jsonl"
    rows = [conversation("a", "short one", "ok"), conversation("b", "word " * 200, "ok"),
            {"id": "c", "conversations": [{"from": "gpt", "value": "no question"}]}, conversation("d", "another", "fine")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    def firsts(**kw):
        return [(p.key, p.messages[-1]["content"]) for p in self_data.prompts_from(path, bundled.tokenizer(), max_prompt_tokens=50, **kw)]

    assert firsts() == [("a", "short one"), ("d", "another")]
    # --skip counts usable prompts only, and --limit counts after it.
    assert firsts(skip=1) == [("d", "another")]
    assert firsts(limit=1, skip=1) == [("d", "another")]
    assert firsts(limit=1) == [("a", "short one")]


def test_later_turns_follow_their_history_and_train_on_the_last_reply_only(tmp_path):
    path, out = tmp_path / "convs.jsonl", tmp_path / "replies.jsonl"
    rows = [conversation("a", "first question", "first answer", "second question", "second answer", "word " * 200, "third answer"),
            conversation("b", "only question", "only answer")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    prompts = self_data.prompts_from(path, bundled.tokenizer(), max_prompt_tokens=50, later_turns=True)
    # a's third turn holds more than 50 tokens with its history; each turn keeps the history before it.
    assert [p.key for p in prompts] == ["a", "a/1", "b"]
    assert [m["content"] for m in prompts[1].messages] == ["first question", "first answer", "second question"]
    assert self_data.prompts_from(path, bundled.tokenizer(), max_prompt_tokens=50, later_turns=True, skip=1, limit=1) == prompts[1:2]

    model = tiny_chat_model()
    self_data.generate(model, prompts[:2], out, OPTIONS, batch=2, progress=False)
    written = lines(out)
    assert [(r["id"], r.get("turn", 0)) for r in written] == [("a", 0), ("a", 1)]  # split with its conversation, by id
    assert self_data.answered_ids(out) == {"a", "a/1"}
    assert self_data.generate(model, prompts, out, OPTIONS, batch=2, progress=False)["replies"] == 1  # resumes at b

    # The later turn's history holds the data's reply; only the model's own, the last, is a target under "last".
    tokenizer = bundled.tokenizer()
    messages = data.to_messages(written[1])
    assert messages[1]["content"] == "first answer" and messages[3]["content"] == written[1]["conversations"][-1]["value"]
    ids, every_reply = data.tokenize(tokenizer, messages, "assistant")
    _, last_reply = data.tokenize(tokenizer, messages, "last")
    assert all(every_reply[i] for i, on in enumerate(last_reply) if on)
    data_reply = [i for i, on in enumerate(every_reply) if on and not last_reply[i]]
    assert data_reply and max(data_reply) < last_reply.index(True)  # the data's reply, before it, is no target
    assert tokenizer.decode([t for t, on in zip(ids, last_reply, strict=True) if on]).startswith(messages[3]["content"])


def test_resume_reads_replies_that_hold_unicode_line_separators(tmp_path):
    out = tmp_path / "replies.jsonl"
    replies = [{"id": "a", "conversations": [], "text": "one\u2028two\x85three\u2029"}, {"id": "b", "conversations": []}]
    out.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in replies), encoding="utf-8")
    assert self_data.answered_ids(out) == {"a", "b"}
