# Two commands do everything on a fresh machine: `make run` and `make test`.
# Both make the virtual environment .venv first (python3 -m venv), installing the
# exact versions of requirements.lock, and skip that step when it is up to date.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
NOTEBOOKS := $(sort $(wildcard notebooks/[0-9]*.ipynb))
SHARED_CHECK := ../shared/tools/check_notebooks.py
PROSE_CHECK := ../shared/tools/check_prose_numbers.py
# TensorFlow C++ log: fatal only (jacutil/core/_tf.py says why)
export TF_CPP_MIN_LOG_LEVEL := 3
export JUPYTER_PREFER_ENV_PATH := 1
export PYDEVD_DISABLE_FILE_VALIDATION := 1

.PHONY: setup run test lint notebooks minutes lab learner site lock clean bench bench-peers fuzz

setup: $(STAMP)

$(STAMP): pyproject.toml requirements.lock
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade "pip>=24"
	$(BIN)/python -m pip install --quiet -c requirements.lock -e ".[notebooks,test,site]"
	# DP-SGD's accountant (notebook 09): every dp-accounting release pins attrs<24
	# or absl-py<2, against the lock, yet its code runs with both: no pins.
	$(BIN)/python -m pip install --quiet --no-deps "dp-accounting==0.6.0"
	$(BIN)/python -m ipykernel install --sys-prefix --name python3 \
		--display-name "Python 3 (jacutil)" > /dev/null
	touch $(STAMP)

# Execute every notebook headless into build/executed/, export HTML to build/html/,
# and print a one-screen summary.
run: setup
	@$(call scratch) $(BIN)/python scripts/run_notebooks.py $(NOTEBOOKS)

# Lint, then one pytest run: the unit tests, papermill with small parameters and
# nbval (strict) over the stored outputs. One run, not two, so that the two
# workers stay busy to the end: xdist hands out the largest groups first (a
# notebook's nbval cells are one group: NotebookGroups in conftest.py) and the
# single tests fill the gaps.
# Nothing can hold CI to its hard limit (90 min; the whole run takes about 35):
# a test fails after pytest-timeout's limit (pyproject.toml), a crashed worker
# ends the run instead of being replaced (--max-worker-restart 0: a replaced
# worker can wait forever under --dist loadgroup), and the pytest run is
# interrupted (SIGINT: pytest still prints its report) after $(1) seconds
# (--foreground: Ctrl-C still reaches pytest).
bounded = timeout --foreground --signal=INT --kill-after=60 $(1)
# The start of a recipe line whose processes keep their temporary files in a
# folder of their own (TMPDIR), removed however the line ends (but SIGKILL).
scratch = scratch=$$(mktemp -d -t jacutil-scratch.XXXXXX) && \
	trap 'rm -rf "$$scratch"' EXIT && trap 'exit 130' INT TERM && \
	export TMPDIR="$$scratch" &&
# The last check judges only the folders of this run (build/.test-started): a
# run killed earlier on this machine may have left its own.
# Every process of the run (pytest, its workers, the notebooks' kernels, the
# JupyterLab server) writes its temporary files in one folder of its own
# (TMPDIR), removed when the run ends, passed or failed or interrupted: a
# kernel that is stopped, not asked to exit, leaves autograph's generated
# modules behind (about 1,000 files a run in /tmp before).
test: setup lint
	@mkdir -p build && touch build/.test-started
	@$(call scratch) \
	$(call bounded,3600) $(BIN)/python -m pytest notebooks tests --nbval --nbval-current-env \
		--nbval-sanitize-with tests/sanitize.cfg --nbval-cell-timeout 600 \
		-n 2 --dist loadgroup --max-worker-restart 0 --durations=20 && \
	$(BIN)/python -c "import os; \
		from jacutil.scale.workers import leftovers as l, leftover_folders as f; \
		since = os.path.getmtime('build/.test-started'); \
		assert not l(), f'processes left behind by LocalWorkers: {l()}'; \
		assert not f(since), f'folders left behind by LocalWorkers or a pool: {f(since)}'"

# The generated-model test (tests/test_generated_models.py) for longer, with a
# random seed: FUZZ_EXAMPLES examples per test (5 tests; a model example costs
# about 2-5 CPU seconds, so the default runs about an hour on 2 cores), and
# shrinking on, so that a failure prints as a small program that builds the
# model. Repeat a run with make fuzz FUZZ_SEED=<the seed it printed>. Each test's
# outcome prints as it ends (-v), and the first failure ends the run and prints
# its example at once (-x): pytest-xdist prints failures only in its last report.
FUZZ_EXAMPLES ?= 500
ifndef FUZZ_SEED
FUZZ_SEED := $(shell od -An -N4 -tu4 /dev/urandom | tr -d ' ')
endif
fuzz: setup
	@echo "make fuzz: seed $(FUZZ_SEED), $(FUZZ_EXAMPLES) examples per test" \
		"(repeat it: make fuzz FUZZ_SEED=$(FUZZ_SEED) FUZZ_EXAMPLES=$(FUZZ_EXAMPLES))"
	JACUTIL_FUZZ=1 JACUTIL_FUZZ_EXAMPLES=$(FUZZ_EXAMPLES) $(BIN)/python -m pytest \
		tests/test_generated_models.py -n 2 --dist load -p no:cacheprovider --timeout 0 -v -x \
		--hypothesis-seed=$(FUZZ_SEED) --hypothesis-show-statistics; \
		status=$$?; echo "make fuzz: seed $(FUZZ_SEED)"; exit $$status

lint: setup
	$(BIN)/ruff check .
	@if [ -f $(SHARED_CHECK) ]; then $(BIN)/python $(SHARED_CHECK) notebooks; fi
	@if [ -f $(PROSE_CHECK) ]; then $(BIN)/python $(PROSE_CHECK) notebooks; fi

# Rebuild notebooks/NN-*.ipynb from their sources in notebooks/src/ and store the
# outputs of one top-to-bottom run with the default parameters.
notebooks: setup
	$(BIN)/python scripts/build_notebooks.py $(if $(ONLY),$(ONLY),notebooks/src/*.py)
	$(BIN)/python scripts/course_minutes.py --write $(NOTEBOOKS)

# Each notebook's minutes, measured (scripts/course_minutes.py), written into
# README's plan and INSTRUCTORS.md (make notebooks does it after a build).
minutes: setup
	$(BIN)/python scripts/course_minutes.py --write $(NOTEBOOKS)

lab: setup
	$(BIN)/jupyter lab notebooks

# Learner copies for a workshop: outputs cleared, solutions emptied to stubs.
learner: setup
	$(BIN)/python scripts/make_learner.py $(NOTEBOOKS)

# The course website in build/site/ (open build/site/index.html): a page per
# notebook from its stored outputs (nothing is executed), the README, the
# instructor notes, the API reference and search; nothing loaded from the web.
site: setup
	$(BIN)/python scripts/build_site.py --out build/site

# Refresh requirements.lock from what is installed (after changing pyproject.toml).
# Benchmark peers (make bench-peers) are not part of the lock.
lock:
	$(BIN)/python -m pip freeze --exclude-editable \
		| grep -v -i -E '^(jacutil|jax|jaxlib|torch|sympy|mpmath|networkx|filelock|dp-accounting|asdfghjkl|backpack-for-pytorch|curvlinops-for-pytorch|einconv|einops|laplace-torch|lightning-utilities|linear-operator|linear_operator|opacus|torchmetrics|unfoldnd|chex|optax|pydantic|pydantic-core|pydantic_core|annotated-types|typing-inspection|jax-privacy|jax_privacy)==' \
		> requirements.lock

# Every path on the question's MLP (n = 100, 1,000, 10,000), the CNN and the LSTM
# (n = 100, 2,000) in one run (minutes): tables, ratios to the loop, the
# fastest path, the write floor and the faster peer, and a log-log plot in
# build/bench/. A quick look: make bench BENCH_ARGS=--quick (n = 100, 1,000).
# Then a private epoch against a plain one, and Levenberg-Marquardt with
# preconditioned CG against Adam, time to the same training MSE (second_order).
bench: setup
	$(BIN)/python -m jacutil.bench --model mlp cnn lstm $(BENCH_ARGS)
	$(BIN)/python -m jacutil.bench.privacy_rows
	$(BIN)/python -m jacutil.bench.second_order

# The same, with JAX and PyTorch (torch==2.13.0, CPU) as peers in the same run.
# They install next to the locked packages without changing any of them; the
# CPU index offers torch 2.13.0+cpu, which pip prefers to the CUDA build.
# Then the peer rows (peers.md): per-sample gradients of a squared-error loss
# and their norms (MLP, CNN, LSTM; n = 1,000, 10,000), and the Jacobian of the
# MLP (n = 100), a residual MLP and a two-head model (n = 2,000), each against
# jit(vmap(grad/jacrev)) and torch.func on the same weights, with its proof.
# Then issue 38's rows again, each library in its own process (interleaved
# rounds, medians) beside one process, with each ratio to the fastest peer and
# whether the aim holds in both (fair.md); there also the J of the CNN and the
# LSTM against the write floor and the last-layer Laplace predictive. Then the curvature rows (notebook
# 11): G's diagonal against BackPACK's DiagGGNExact, G v against curvlinops, the NTK against JAX, a last-layer
# Laplace predictive against laplace-torch. Those peers go in with --no-deps:
# their requirements would pull torchvision, whose build does not load beside
# torch+cpu. PyTorch runs on one thread (its default threads vary tenfold here),
# except under Opacus: the private epochs (privacy_rows --peer: Opacus with
# ghost clipping and jax_privacy's Keras API on the JAX backend, each in its
# own process, on the classifier and the small CNN) take its default threads,
# which that table prints.
bench-peers: setup
	$(BIN)/python -m pip install --quiet -c requirements.lock jax "torch==2.13.0" \
		chex optax pydantic --extra-index-url https://download.pytorch.org/whl/cpu
	$(BIN)/python -m pip install --quiet --no-deps backpack-for-pytorch==1.7.1 \
		curvlinops-for-pytorch==3.0.1 laplace-torch==0.3 einops==0.8.2 unfoldNd==0.2.3 \
		einconv==0.1.0 asdfghjkl==0.1a4 torchmetrics==1.9.0 lightning-utilities==0.15.3 \
		linear_operator==0.6.1 opacus==1.6.0 jax-privacy==2.0.0
	$(BIN)/python -m jacutil.bench --model mlp cnn lstm --peer-rows $(BENCH_ARGS)
	$(BIN)/python -m jacutil.bench.isolated
	$(BIN)/python -m jacutil.bench.first_call
	$(BIN)/python -m jacutil.bench.curvature_rows --torch-threads 1
	$(BIN)/python -m jacutil.bench.curvature_rows --wide
	$(BIN)/python -m jacutil.bench.privacy_rows --peer $(BIN)/python

clean:
	rm -rf build .pytest_cache .hypothesis
