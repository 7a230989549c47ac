PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test up lint format rdma clean

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PY) -m venv $(VENV) || python3 -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[dev]'
	# pyverbs for the rdma backend: best effort (needs apt); without it the rdma tests that
	# need the real library skip and say why.
	scripts/install_pyverbs.sh $(VENV) >/dev/null 2>&1 || echo "pyverbs not installed (run: make rdma)"
	touch $(STAMP)

install: $(STAMP)

test: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider

rdma: $(STAMP)
	scripts/install_pyverbs.sh $(VENV)

up: $(STAMP)
	$(BIN)/kvmesh up

lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf $(VENV)
