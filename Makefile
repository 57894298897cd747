# Two commands on a fresh machine: `make run` (set up + run the pipeline end to end) and `make test`.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test test-slow up browser docker strace nginx mosquitto postgresql foxglove docs gpu-wheels

setup: $(STAMP)

# torch is pinned to the CPU build via constraints.txt; GPU hosts install `.[gpu]` without it.
$(STAMP): pyproject.toml constraints.txt edge/pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[test]'
	touch $@

run: setup
	$(BIN)/sim2edge run

up: setup
	$(BIN)/sim2edge up

# Debian's chromium for the browser-driven UI test (as root; elsewhere that test skips and says why)
browser:
	@command -v chromium >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q chromium >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q chromium >/dev/null; } || true

# Debian's Docker engine and registry for the image tests (as root; elsewhere those tests skip and say why)
docker:
	@{ command -v dockerd >/dev/null && command -v docker-registry >/dev/null; } || [ "$$(id -u)" != 0 ] \
		|| apt-get install -y -q docker.io docker-registry >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q docker.io docker-registry >/dev/null; } || true

# Debian's strace for the power-loss ordering test (as root; elsewhere that test skips and says why)
strace:
	@command -v strace >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q strace >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q strace >/dev/null; } || true

# Debian's nginx serves the TUF repository on loopback in tests/test_tuf.py (as the test's own process)
nginx:
	@command -v nginx >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q nginx >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q nginx >/dev/null; } || true

# Debian's mosquitto is the MQTT broker of tests/test_mqtt_reports.py (as the test's own process)
mosquitto:
	@command -v mosquitto >/dev/null || [ "$$(id -u)" != 0 ] || apt-get install -y -q mosquitto >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q mosquitto >/dev/null; } || true

# Foxglove's MCAP and ROS 2 message libraries (npm, exact versions in tests/js/package-lock.json) into
# tests/js/node_modules for tests/test_mcap_foxglove.py (needs Node and npm; elsewhere that test skips and says why);
# reinstalled only when the lock file is newer than the install
foxglove:
	@[ tests/js/node_modules/.package-lock.json -nt tests/js/package-lock.json ] || ! command -v npm >/dev/null \
		|| npm ci --prefix tests/js --no-audit --no-fund --silent >/dev/null || true

# -rs: every skip says why; --durations: the slowest tests, to keep the default run under 25 min on 2 cores;
# under CI=true a skip for chromium, Docker, strace or namespaces fails (tests/ci_skips.py).
# The default run holds one whole pipeline (tests/test_e2e.py); `make test-slow` runs the other trainings end to end.
# Debian's PostgreSQL 15 for `sim2edge up --database` (tests/test_up_postgres.py runs it as the test's own process)
postgresql:
	@test -x /usr/lib/postgresql/15/bin/initdb || [ "$$(id -u)" != 0 ] || apt-get install -y -q postgresql >/dev/null \
		|| { apt-get update -q >/dev/null && apt-get install -y -q postgresql >/dev/null; } || true

test: setup browser docker strace nginx mosquitto postgresql foxglove
	$(BIN)/python -m pytest -q -rs --durations=40 -p no:cacheprovider -m "not slow" tests

# the slow tests include MuJoCo Warp's parity with C MuJoCo: its `warp` extra (~590 MB) is installed here only
test-slow: setup browser docker strace nginx mosquitto postgresql foxglove
	$(BIN)/python -m pip install -q -c constraints.txt -e '.[warp]'
	$(BIN)/python -m pytest -q -rs --durations=40 -p no:cacheprovider -m slow tests

# The reference in docs/ (MkDocs, Material theme) into site/; --strict fails on a broken link, anchor or nav entry.
docs: setup
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict -d site

# The wheels benchmarks/gpu_check.sh installs on a GPU machine (it has torch with CUDA, onnx, onnxruntime, numpy),
# for CPython 3.11-3.13, into .gpu-wheels/ (carried to the machine; the device tool's limit is 64 MiB).
gpu-wheels: setup
	rm -rf .gpu-wheels
	for v in 3.11 3.12 3.13; do $(BIN)/python -m pip download -q --no-deps --only-binary=:all: \
		--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux2014_x86_64 \
		--python-version $$v -d .gpu-wheels -r benchmarks/gpu_requirements.txt || exit 1; done
	du -sh .gpu-wheels
