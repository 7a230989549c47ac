PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install test test-fast up lint format rdma clean bench-deps llama-server gpu-check gpu-check-dry compose-test

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

# The pure cores: every test that starts no process and is not marked slow (tests/conftest.py
# marks the rest `processes`), a few minutes on two cores.
test-fast: $(STAMP)
	TRITON_INTERPRET=1 $(BIN)/python -m pytest -q -p no:cacheprovider -m "not slow and not processes"

# The GPU path on a CUDA machine: gpu-marked tests + GPU benchmarks + a SoftRoCE attempt, one JSON
# (docs/gpu.md). Without CUDA it says so and exits 0. Never with TRITON_INTERPRET: compiled kernels.
gpu-check: $(STAMP)
	env -u TRITON_INTERPRET $(BIN)/python scripts/gpu_check.py

# The same script on the CPU at tiny sizes (Triton interpreted): a code-path check, not GPU figures.
gpu-check-dry: $(STAMP)
	$(BIN)/python scripts/gpu_check.py --device cpu

# docker-compose.yml run for real (docs/deploy.md): Docker, compose and debootstrap from apt where
# missing (root), a dockerd started and stopped where none runs, the images built with no registry
# (debootstrap base, wheelhouse from .venv), up --scale prefill=2 --scale decode=2, the checks
# (one line each), down -v. COMPOSE_TEST_ARGS: e.g. --model DIR, --if-possible.
compose-test: $(STAMP)
	$(BIN)/python scripts/compose_test.py $(COMPOSE_TEST_ARGS)

# Optional: llama.cpp for `kvmesh bench engine --against llama.cpp`, never part of `make test`.
# llama-cpp-python has no wheel: it builds from its sdist (minutes); the GGUF converter, its
# conversion/ package and the gguf-py it was written against come out of the same sdist.
LLAMA_CPP_PYTHON := 0.3.36
LLAMA_CPP_SDIST := llama_cpp_python-$(LLAMA_CPP_PYTHON)
LLAMA_CPP_SHARE := $(VENV)/share/kvmesh/llama.cpp
# Tuned for this CPU (GGML_NATIVE), except on one with AMX: 0.3.36's ggml then takes its AMX
# path for Q8_0 and Q4 weights, which segfaults in llama_decode on SmolLM2 (seen on a
# Sapphire Rapids VM, 2026-12-06); there every x86 extension of the CPU but AMX is named.
LLAMA_CPP_ISA := $(shell grep -qw amx_int8 /proc/cpuinfo 2>/dev/null \
	&& echo -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON \
	-DGGML_BMI2=ON -DGGML_AVX_VNNI=ON -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON \
	-DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON || echo -DGGML_NATIVE=ON)

bench-deps: $(STAMP)
	mkdir -p $(LLAMA_CPP_SHARE)
	test -f $(LLAMA_CPP_SHARE)/$(LLAMA_CPP_SDIST).tar.gz || $(BIN)/pip download -q --no-deps \
		--no-binary :all: -d $(LLAMA_CPP_SHARE) 'llama-cpp-python==$(LLAMA_CPP_PYTHON)'
	CMAKE_ARGS="$(LLAMA_CPP_ISA)" $(BIN)/pip install $(LLAMA_CPP_SHARE)/$(LLAMA_CPP_SDIST).tar.gz \
		'sentencepiece>=0.2'
	tar xzf $(LLAMA_CPP_SHARE)/$(LLAMA_CPP_SDIST).tar.gz -C $(LLAMA_CPP_SHARE) --strip-components=3 \
		$(LLAMA_CPP_SDIST)/vendor/llama.cpp/convert_hf_to_gguf.py \
		$(LLAMA_CPP_SDIST)/vendor/llama.cpp/conversion $(LLAMA_CPP_SDIST)/vendor/llama.cpp/gguf-py

# Optional: llama.cpp's own server for `kvmesh bench serve --compare ...,http://HOST:PORT`
# (docs/load.md), built from the llama.cpp sources vendored in the same sdist: CPU only, tuned
# for this machine (GGML_NATIVE), no web UI (nothing is downloaded), static, into $(BIN).
LLAMA_SERVER_SRC := $(LLAMA_CPP_SHARE)/src
LLAMA_SERVER_BUILD := $(LLAMA_CPP_SHARE)/build

llama-server: $(BIN)/llama-server

$(BIN)/llama-server:
	mkdir -p $(LLAMA_CPP_SHARE) $(LLAMA_SERVER_SRC)
	test -f $(LLAMA_CPP_SHARE)/$(LLAMA_CPP_SDIST).tar.gz || $(BIN)/pip download -q --no-deps \
		--no-binary :all: -d $(LLAMA_CPP_SHARE) 'llama-cpp-python==$(LLAMA_CPP_PYTHON)'
	tar xzf $(LLAMA_CPP_SHARE)/$(LLAMA_CPP_SDIST).tar.gz -C $(LLAMA_SERVER_SRC) --strip-components=3 \
		$(LLAMA_CPP_SDIST)/vendor/llama.cpp
	cmake -S $(LLAMA_SERVER_SRC) -B $(LLAMA_SERVER_BUILD) -DCMAKE_BUILD_TYPE=Release \
		$(LLAMA_CPP_ISA) -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF \
		-DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
		-DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_CUDA=OFF -DGGML_METAL=OFF
	cmake --build $(LLAMA_SERVER_BUILD) --target llama-server -j $$(nproc)
	cp $(LLAMA_SERVER_BUILD)/bin/llama-server $(BIN)/llama-server

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
