"""llama.cpp's side of the benchmarks, the engine a CPU user would pick instead: the model's GGUF as
shipped (the bundled SmolLM2 is Q4_1), greedy, through `llama-cpp-python` (the optional extra
`pip install 's3d-jax[llama]'`). With `lookup`, llama.cpp's own speculative decoding: prompt lookup,
`LlamaPromptLookupDecoding`. Never imports JAX.

    python -m s3d_jax.bench.llama_cpp_peer REQUEST RESULT     # a child of s3d_jax.bench or tools/bench_decode.py
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

from s3d_jax.bench import harness
from s3d_jax.bench.suites import BenchError, run_turns

EXTRA = "pip install 's3d-jax[llama]' (it builds llama.cpp, a few minutes)"
# llama-cpp-python 0.3.36 built for a CPU with AMX (its default, GGML_NATIVE) crashed on every
# quantized GGUF on a Sapphire Rapids Xeon, in its AMX weights; without AMX it runs (docs/benchmarks.md).
WITHOUT_AMX = ('CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON '
               '-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON" '
               "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python")


def require() -> None:
    """Raises BenchError naming the extra to install when llama-cpp-python is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        raise BenchError(f"the llama.cpp peer needs llama-cpp-python: {EXTRA}")


def run(request: dict) -> dict:
    """`run_llama_cpp(request)` in a process of its own (`harness.run_engine`); a crash raises
    BenchError, with the rebuild that avoided it where llama.cpp uses AMX."""
    try:
        return harness.run_engine(["-m", __name__], request)
    except harness.EngineFailed as e:
        amx = "AMX_INT8 = 1" in system_info()
        raise BenchError(f"{e}" + (f"; this llama.cpp build uses AMX, which crashed on quantized GGUFs here: rebuild it "
                                   f"without, {WITHOUT_AMX}" if amx and e.returncode < 0 else "")) from None


def system_info() -> str:
    """What llama.cpp was built for (its CPU features), or "" where llama-cpp-python is missing."""
    if importlib.util.find_spec("llama_cpp") is None:
        return ""
    import llama_cpp

    return llama_cpp.llama_print_system_info().decode()


def run_llama_cpp(request: dict) -> dict:
    """`gguf` (a file), `tokenizer` (a directory with the same tokenizer and its chat template),
    `prompts` (see suites.run_turns), `max_new_tokens`, `lookup` (prompt-lookup drafts or none),
    `stop_at_eos` -> every turn's record and the peak memory."""
    require()
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding
    from transformers import PreTrainedTokenizerFast

    draft = LlamaPromptLookupDecoding(num_pred_tokens=10) if request["lookup"] else None
    llm = llama_cpp.Llama(model_path=request["gguf"], n_ctx=4096, n_threads=os.cpu_count(), draft_model=draft, verbose=False)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(request["tokenizer"])  # the same ids and template as ours
    eos = {llm.token_eos(), tokenizer.eos_token_id} - {None} if request["stop_at_eos"] else set()

    def generate(item, messages):
        if messages is None:
            ids = tokenizer(item["text"])["input_ids"]
        else:
            ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        llm.reset()
        tokens, start = [], time.perf_counter()
        for token in llm.generate(list(ids), top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0):
            tokens.append(int(token))
            if token in eos or len(tokens) >= request["max_new_tokens"]:
                break
        seconds = time.perf_counter() - start
        return {"tokens": tokens, "text": tokenizer.decode(tokens, skip_special_tokens=True), "seconds": seconds}

    records = run_turns(request["prompts"], generate)
    return {"records": records, "peak_memory_mib": harness.peak_rss_mib(), "memory_kind": "process peak RSS",
            "llama_cpp": llama_cpp.__version__}


def requantized_gguf(src: str | os.PathLike, dst: str | os.PathLike, block_type: str = "Q8_0") -> str:
    """A copy of the GGUF `src` at `dst` with every matrix in `block_type` (dequantized and quantized
    again by the `gguf` package, as llama.cpp's own quantizer rounds): the same model at another
    precision for llama.cpp. Metadata and vectors are copied as they are. Written once: an existing
    `dst` is returned."""
    import gguf

    if os.path.exists(dst):
        return str(dst)
    kind = gguf.GGMLQuantizationType[block_type]
    reader = gguf.GGUFReader(str(src))
    tmp = f"{dst}.tmp{os.getpid()}"
    writer = gguf.GGUFWriter(tmp, reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name == "general.architecture" or field.name.startswith("GGUF."):
            continue  # written by the writer itself
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == gguf.GGUFValueType.ARRAY else None
        value = field.contents()
        if field.name == "general.file_type":  # what the file now mostly holds
            value = int(gguf.LlamaFileType.ALL_F32 if block_type == "F32" else gguf.LlamaFileType[f"MOSTLY_{block_type}"])
        writer.add_key_value(field.name, value, value_type, sub_type=sub_type)
    for tensor in reader.tensors:
        weight = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
        if weight.ndim == 2:
            writer.add_tensor(tensor.name, gguf.quants.quantize(weight, kind), raw_dtype=kind)
        else:
            writer.add_tensor(tensor.name, weight)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    os.replace(tmp, dst)
    return str(dst)


if __name__ == "__main__":
    sys.exit(harness.serve(run_llama_cpp, *sys.argv[1:]))
