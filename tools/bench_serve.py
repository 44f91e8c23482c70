"""The server under load: concurrent streaming clients on MT-Bench prompts, S3D against plain decoding
at each concurrency, and llama.cpp's own OpenAI server on the same GGUF where llama-cpp-python is installed.

    python tools/bench_serve.py [--concurrency 1,4,8,16,64] [--requests 16] [--max-tokens 128] [--max-queue 16] \
        [--dtypes float32,int4] [--llama-cpp]

Each engine runs as its own server process, started here on a free port; all are started first, then
each concurrency level measures them one after another, each alone while the others idle. Per
concurrency: aggregate generated tokens/s over the wall time, and per request the time to first
token (TTFT) and time per output token after it (TPOT), p50 and p95, and how many requests the full
queue refused (each is retried after its Retry-After) and how many were lost. Writes `serve.json`,
`serve.md` and `serve_throughput.png` to --out.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from s3d_jax import bundled  # noqa: E402
from s3d_jax.bench.suites import load_suite  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(command: list[str], port: int, timeout: float = 900) -> subprocess.Popen:
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_serve_{port}.log", "w")  # noqa: SIM115 - the server's lifetime
    server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{command[:4]} exited with {server.returncode}; see {log.name}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return server
        except httpx.TransportError:
            time.sleep(1)
    server.kill()
    raise RuntimeError(f"{command[:4]} did not answer within {timeout:.0f} s; see {log.name}")


def one_request(url: str, model: str, prompt: str, max_tokens: int, give_up_after: float = 1800) -> dict:
    """A streamed chat completion, retried as `Retry-After` says while the server's queue is full: when
    its first text came (from its accepted try), when it ended, how many tokens it had, and how often it
    was refused. A request that fails otherwise, or is still refused after `give_up_after` seconds, is lost."""
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "stream_options": {"include_usage": True}}
    deadline, refused = time.monotonic() + give_up_after, 0
    while time.monotonic() < deadline:
        start, first, tokens = time.perf_counter(), None, 0
        try:
            with httpx.stream("POST", f"{url}/v1/chat/completions", json=body, timeout=600) as response:
                if response.status_code in (429, 503):
                    refused += 1
                    time.sleep(float(response.headers.get("Retry-After", 1)))
                    continue
                response.raise_for_status()
                usage, pieces = None, 0
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    if any((c.get("delta") or {}).get("content") for c in chunk.get("choices", [])):
                        pieces += 1
                        first = first or time.perf_counter()
                # llama-cpp-python's server sends no usage when streaming; it streams one token per chunk.
                tokens = usage["completion_tokens"] if usage else pieces
        except httpx.HTTPError as e:
            return {"lost": f"{type(e).__name__}: {e}", "refused": refused}
        end = time.perf_counter()
        first = first or end
        return {"ttft": first - start, "tpot": (end - first) / max(tokens - 1, 1), "tokens": tokens, "seconds": end - start,
                "refused": refused}
    return {"lost": f"still refused after {give_up_after:.0f} s", "refused": refused}


def load_level(url: str, model: str, prompts: list[str], concurrency: int, max_tokens: int) -> dict:
    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: one_request(url, model, p, max_tokens), prompts))
    wall = time.perf_counter() - start
    served = [d for d in done if "lost" not in d]
    ttft, tpot = np.array([d["ttft"] for d in served] or [np.nan]), np.array([d["tpot"] for d in served] or [np.nan])
    tokens = sum(d["tokens"] for d in served)
    return {"concurrency": concurrency, "requests": len(done), "lost": len(done) - len(served),
            "refusals": sum(d["refused"] for d in done), "lost_reasons": sorted({d["lost"] for d in done if "lost" in d}),
            "tokens": tokens, "seconds": wall, "tokens_per_s": tokens / wall,
            "ttft_p50_ms": 1e3 * np.percentile(ttft, 50), "ttft_p95_ms": 1e3 * np.percentile(ttft, 95),
            "tpot_p50_ms": 1e3 * np.percentile(tpot, 50), "tpot_p95_ms": 1e3 * np.percentile(tpot, 95)}


def decode_first_token_ms(model_path: str | None, prompts: list[str]) -> float:
    """`s3d_jax.decode`'s time to its first token, which its prefill emits: the median over `prompts`,
    each decoded once to compile its bucket and once to time. A lone server request's TTFT is held
    against it. Measured here, before any server starts."""
    import s3d_jax

    model = s3d_jax.load(model_path)
    seconds = []
    for prompt in prompts:
        for _ in range(2):
            out = s3d_jax.decode(model, [{"role": "user", "content": prompt}], method="ar", max_new_tokens=1, chat=True)
        seconds.append(out.stats.decode_seconds)
    return 1e3 * float(np.median(seconds))


def engines(args) -> dict[str, list[str]]:
    """Each engine's server command (the port is appended)."""
    serve = [sys.executable, "-m", "s3d_jax.serve", "--max-batch", str(args.max_batch), "--max-queue", str(args.max_queue),
             "--max-len", str(args.max_len),
             "--served-model-name", "model"] + (["--model", args.model] if args.model else [])
    found = {}
    for dtype in args.dtypes.split(","):
        for method in args.methods.split(","):
            found[f"s3d_jax {method}" + (f" {dtype}" if dtype != "float32" else "")] = [*serve, "--method", method, "--dtype", dtype]
    if args.llama_cpp:
        gguf = args.gguf or str(bundled.gguf_path())
        # One request at a time, each to its end: by default a new request interrupts the one streaming.
        found["llama.cpp"] = [sys.executable, "-m", "llama_cpp.server", "--model", gguf, "--model_alias", "model",
                              "--n_ctx", str(args.max_len), "--n_threads", str(os.cpu_count()), "--interrupt_requests", "False"]
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="converted model directory (default: the bundled SmolLM2)")
    p.add_argument("--methods", default="ar,s3d")
    p.add_argument("--dtypes", default="float32", help="the s3d_jax servers' weights, for example float32,int4")
    p.add_argument("--concurrency", default="1,4,8,16,64")
    p.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least the concurrency)")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--max-batch", type=int, default=8, help="the s3d_jax server's slots")
    p.add_argument("--max-queue", type=int, default=16, help="the s3d_jax server's waiting list; clients retry when it is full")
    p.add_argument("--max-len", type=int, default=2048, help="the servers' context window")
    p.add_argument("--llama-cpp", action="store_true", help="also llama-cpp-python's server on the GGUF")
    p.add_argument("--gguf", default=None, help="the GGUF for --llama-cpp (default: the bundled one)")
    p.add_argument("--out", default="results/serve")
    args = p.parse_args(argv)
    levels = [int(c) for c in args.concurrency.split(",")]
    questions = [q["turns"][0] for q in load_suite("mt_bench", None)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    alone = [questions[(i + 1) % len(questions)] for i in range(args.requests)]  # the prompts of one client's level
    reference = decode_first_token_ms(args.model, alone)
    print(f"s3d_jax.decode's time to its first token (the prefill): {reference:.0f} ms", file=sys.stderr, flush=True)
    results: dict[str, list[dict]] = {}
    servers: dict[str, tuple[subprocess.Popen, str]] = {}
    try:
        for name, command in engines(args).items():  # every server up first: each idles while another is measured
            port = free_port()
            print(f"{name}: starting its server ...", file=sys.stderr, flush=True)
            servers[name] = start([*command, "--port", str(port)], port), f"http://127.0.0.1:{port}"
            one_request(servers[name][1], "model", questions[0], 8)  # warm-up: compiles, calibrates
            results[name] = []
        # Level by level, the engines one after another: a drift in the machine's speed over the run
        # (seen as 25% between two runs of one engine) falls on every engine of a level alike.
        for level in levels:
            n = max(args.requests, level)
            prompts = [questions[(i + 1) % len(questions)] for i in range(n)]
            for name, (_, url) in servers.items():
                row = load_level(url, "model", prompts, level, args.max_tokens)
                results[name].append(row)
                print(f"{name}, {level} clients: {row['tokens_per_s']:.1f} tokens/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                      f"TPOT p50 {row['tpot_p50_ms']:.1f} ms, {row['refusals']} refusals retried, {row['lost']} lost",
                      file=sys.stderr, flush=True)
            # After each level, so that a run cut short keeps what it measured.
            (out / "serve.json").write_text(json.dumps({"args": vars(args), "decode_first_token_ms": reference, "results": results},
                                                       indent=1))
    finally:
        for server, _ in servers.values():
            server.terminate()
            server.wait(120)
    table = render(results) + (f"\n\n`s3d_jax.decode`'s time to its first token (its prefill), median over one client's prompts: "
                               f"{reference:.0f} ms")
    (out / "serve.md").write_text(table + "\n")
    plot(results, out / "serve_throughput.png")
    print(table)
    return 0


def render(results: dict[str, list[dict]]) -> str:
    lines = ["| engine | clients | tokens/s | vs plain | TTFT p50 / p95 ms | TPOT p50 / p95 ms | refusals retried | lost |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for name, rows in results.items():
        # Against plain decoding at the same weights (llama.cpp against float32's).
        dtype = name.split(" ")[2] if name.startswith("s3d_jax") and name.count(" ") == 2 else ""
        plain = {r["concurrency"]: r["tokens_per_s"] for r in results.get(f"s3d_jax ar {dtype}".strip(), [])}
        for r in rows:
            ratio = f"{r['tokens_per_s'] / plain[r['concurrency']]:.2f}x" if r["concurrency"] in plain else "-"
            lines.append(f"| {name} | {r['concurrency']} | {r['tokens_per_s']:.1f} | {ratio} | {r['ttft_p50_ms']:.0f} / "
                         f"{r['ttft_p95_ms']:.0f} | {r['tpot_p50_ms']:.1f} / {r['tpot_p95_ms']:.1f} | {r['refusals']} | {r['lost']} |")
    return "\n".join(lines)


def plot(results: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for name, rows in results.items():
        ax.plot([r["concurrency"] for r in rows], [r["tokens_per_s"] for r in rows], marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent clients")
    ax.set_ylabel("generated tokens/s, all clients")
    ax.set_title("Server throughput, MT-Bench first turns")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    sys.exit(main())
