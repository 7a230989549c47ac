"""The resident memory a model adds to a process that serves it: ``kvmesh bench engine
--memory``.

Each system runs in a fresh process (``python -m kvmesh.loadgen.engine_rss SYSTEM PATH``):
its libraries imported, VmRSS read (the baseline), the weights loaded and one short greedy
generation run (a 16-token prompt, 8 new tokens, a context of 64 positions: the KV cache and
work buffers stay small, and every weight page has been read), VmRSS read again. The
difference is the weights plus the runtime's buffers: what a worker holds for the model. For
kvmesh, ``weights_mb`` is the bytes of the tensors the model holds (each storage once: a tied
head and its embeddings are one), so ``added_mb - weights_mb`` is the runtime: the tokenizer
(~24 MB for SmolLM2's 49,152 tokens), rotary tables, the KV pool, the C kernels' buffers and
what the allocator keeps of freed work tensors.

- ``kvmesh``: the checkpoint as ``load_model`` keeps it (weights as stored where it holds
  them), the C kernels attached as the engine attaches them;
- ``kvmesh-float32``: the same checkpoint with every weight dequantized;
- ``llama.cpp``: a GGUF file through llama-cpp-python (memory-mapped, as llama-server loads it).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

SYSTEMS = ("kvmesh", "kvmesh-float32", "llama.cpp")
PROMPT = list(range(100, 116))
NEW_TOKENS = 8


def rss_mb() -> float:
    """This process's resident set (VmRSS), in MB."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError("no VmRSS in /proc/self/status")


def measure(system: str, path: str | Path, timeout: float = 300) -> dict[str, float]:
    """``system``'s RSS for the model at ``path`` (a checkpoint folder for kvmesh, a GGUF file for
    llama.cpp), measured in a fresh process: baseline_mb, rss_mb, added_mb."""
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; one of {', '.join(SYSTEMS)}")
    proc = subprocess.run(
        [sys.executable, "-m", __name__, system, str(path)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.strip().splitlines()[-10:])
        raise RuntimeError(f"measuring {system}'s memory on {path} failed:\n{tail}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def weights_bytes(model) -> int:
    """Bytes of the tensors ``model`` holds: parameters, buffers and weights kept as stored
    (a ``StackedWeight``'s parts), each storage counted once."""
    import torch

    tensors = [*model.parameters(), *model.buffers()]
    for module in model.modules():
        weight = getattr(module, "qweight", None)
        if weight is not None:
            tensors += [p.data for p in getattr(weight, "parts", (weight,))]
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
        for t in tensors
        if isinstance(t, torch.Tensor) and t.device.type != "meta"
    }
    return sum(storages.values())


def _kvmesh(path: str, dequantize: bool) -> tuple[float, float, float]:
    import torch  # noqa: F401  (imported before the baseline)
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine
    from kvmesh.shared.model.loader import load_model
    from kvmesh.shared.text.sampling import SamplingOptions

    baseline = rss_mb()
    model, tokenizer = load_model(path, dequantize=dequantize)
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=4, enable_prefix_caching=False))
    options = SamplingOptions(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.generate([PROMPT], options)
    return baseline, rss_mb(), weights_bytes(model) / 1e6


def _llama_cpp(path: str) -> tuple[float, float]:
    import llama_cpp  # noqa: F401  (imported before the baseline)
    import torch
    from kvmesh.loadgen.llamacpp_runner import LlamaCppRunner

    baseline = rss_mb()
    runner = LlamaCppRunner(Path(path), 1, 64, torch.float32)
    runner.generate([PROMPT], NEW_TOKENS)
    return baseline, rss_mb()


def main(argv: list[str]) -> int:
    system, path = argv
    weights = None
    if system == "llama.cpp":
        baseline, rss = _llama_cpp(path)
    else:
        baseline, rss, weights = _kvmesh(path, dequantize=system == "kvmesh-float32")
    result = {"baseline_mb": round(baseline, 1), "rss_mb": round(rss, 1)}
    result["added_mb"] = round(rss - baseline, 1)
    if weights is not None:
        result["weights_mb"] = round(weights, 1)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
