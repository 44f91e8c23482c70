"""transformers' side of the benchmarks: PyTorch `generate`, greedy, on the very weights under test
(exported with `tools/convert_hf.py --to-hf`). Imports PyTorch and never JAX, so that a peer's
peak memory is transformers' own.

    python -m s3d_jax.bench.peers REQUEST RESULT     # a child of s3d_jax.bench or tools/bench_decode.py
"""

from __future__ import annotations

import os
import sys
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from s3d_jax.bench import harness
from s3d_jax.bench.suites import run_turns


def load_transformers(hf_dir: str):
    """(model, tokenizer) in float32 PyTorch, using every core."""
    torch.set_num_threads(os.cpu_count())
    return AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval(), AutoTokenizer.from_pretrained(hf_dir)


def run_peer(request: dict) -> dict:
    """`hf_model` (a transformers directory), `prompts` (see suites.run_turns) and `generate`
    (keyword arguments of transformers' `generate`: max_new_tokens, the assistant, ...) -> every
    turn's record and the peak memory."""
    model, tokenizer = load_transformers(request["hf_model"])

    def generate(item, messages):
        if messages is None:
            ids = tokenizer(item["text"], return_tensors="pt")["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)["input_ids"]
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(ids, do_sample=False, **request["generate"])
        seconds = time.perf_counter() - start
        tokens = out[0, ids.shape[1] :].tolist()
        return {"tokens": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True), "seconds": seconds}

    records = run_turns(request["prompts"], generate)
    return {"records": records, "peak_memory_mib": harness.peak_rss_mib(), "memory_kind": "process peak RSS", "torch": torch.__version__}


if __name__ == "__main__":
    sys.exit(harness.serve(run_peer, *sys.argv[1:]))
