"""Start-up stays fast: building the CLI parser imports no torch, the router (which reads a
model's config and tokenizer and never computes) imports none, and loading a model (what every
prefill, decode and draft worker does first) imports none of torch's compiler stack."""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import sys
import kvmesh.cli
parser = kvmesh.cli.build_parser()
for argv in (["--help"], ["bench", "--help"], ["bench", "xfer", "--help"]):
    try:
        parser.parse_args(argv)
    except SystemExit:
        pass
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_cli_help_does_not_import_torch():
    # A fresh interpreter: in this one, other tests may already have imported torch.
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"


_ROUTER_PROBE = """
import sys
from kvmesh.services.router.service import serve_router
from kvmesh.services.router.model_info import load_model_info
for name in sys.argv[1:]:
    info = load_model_info(name, "served", None)
    print(name, info.max_model_len, info.spec, info.tokenizer.vocab_size)
print(sorted(m for m in sys.modules if m == "torch" or m.startswith("torch.")))
"""


def test_the_router_imports_no_torch(tmp_path):
    # torch costs a router 2-3 s of CPU at start and ~200 MB of memory, for nothing it uses
    from kvmesh.shared.model.identity import model_spec
    from kvmesh.shared.model.loader import load_model
    from support.hf_fixtures import make_llama_checkpoint

    checkpoint = str(make_llama_checkpoint(tmp_path, dtype="bfloat16"))
    proc = subprocess.run(
        [sys.executable, "-c", _ROUTER_PROBE, "kvmesh-tiny", checkpoint],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    *infos, modules = proc.stdout.strip().splitlines()
    assert modules == "[]"
    # the spec a decode worker advertises for the model it loaded: the router places on it
    for line, name in zip(infos, ("kvmesh-tiny", checkpoint), strict=True):
        model, tokenizer = load_model(name)
        context = model.config.max_position_embeddings
        assert line == f"{name} {context} {model_spec(model.config)} {tokenizer.vocab_size}"


_LOAD_PROBE = """
import sys
from kvmesh.shared.model.loader import load_model
load_model("kvmesh-tiny")
print(sorted(m for m in ("torch._dynamo", "sympy", "triton") if m in sys.modules))
"""


def test_loading_a_model_imports_no_dynamo_sympy_or_triton():
    # torch's meta-device init and empty_like go through Python references that import them:
    # seconds of CPU at every worker's start (the loader avoids both)
    proc = subprocess.run(
        [sys.executable, "-c", _LOAD_PROBE], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[]"
