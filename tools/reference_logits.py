"""Records transformers' logits for a model known by name, read from its own GGUF, as the reference
that tests/test_qwen_coder.py compares the conversion against: loading the 0.5B model in transformers
takes 40-60 s on 2 cores, every run, for numbers that only change with the file.

    python tools/reference_logits.py                      # tests/data/qwen_coder_hf_logits.npz

It keeps the prompt's first token ids as transformers' tokenizer gives them and, at each of those
positions, the logits of every `--stride`-th vocabulary id and of that position's `--top` largest,
with the largest magnitude over the whole vocabulary, beside the GGUF's sha256 and the versions that
produced them (about 50 KB).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from s3d_jax import bundled

ROOT = Path(__file__).resolve().parents[1]
PROMPT = "Write a Python function that checks whether a number is prime."


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=bundled.QWEN_CODER.name, help="a model known by name")
    p.add_argument("--tokens", type=int, default=12, help="how many of the prompt's tokens")
    p.add_argument("--stride", type=int, default=151, help="keep every N-th vocabulary id")
    p.add_argument("--top", type=int, default=32, help="and each position's N largest logits")
    p.add_argument("--out", default=str(ROOT / "tests" / "data" / "qwen_coder_hf_logits.npz"))
    args = p.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    named = bundled.named(args.model)
    gguf = named.gguf()  # joined and checked against its sha256
    ids = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).encode(PROMPT)[: args.tokens]
    print(f"loading {gguf} in transformers {transformers.__version__} ...")
    hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0].numpy()
    strided = np.arange(0, logits.shape[1], args.stride)
    columns = np.concatenate([np.broadcast_to(strided, (len(ids), len(strided))), np.argsort(logits, 1)[:, -args.top :]], 1)
    columns = columns.astype(np.int32)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        args.out, ids=np.array(ids, np.int32), columns=columns, logits=np.take_along_axis(logits, columns, 1),
        largest=np.float32(np.abs(logits).max()), vocab_size=logits.shape[1], sha256=named.sha256,
        made_by=f"transformers {transformers.__version__}, torch {torch.__version__}", prompt=PROMPT,
    )
    print(f"wrote {args.out}: {len(ids)} positions x {columns.shape[1]} of {logits.shape[1]} ids")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
