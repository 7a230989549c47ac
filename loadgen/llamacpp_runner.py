"""llama.cpp as the reference of ``kvmesh bench engine --against llama.cpp``.

llama.cpp runs in-process through ``llama-cpp-python`` on a GGUF file converted from the same
Hugging Face checkpoint by the converter that ships with llama.cpp (``convert_hf_to_gguf.py``
and its ``conversion``/``gguf-py`` folders, from the llama-cpp-python sdist). None of this is a
kvmesh dependency: ``make bench-deps`` builds and installs it, and ``missing()`` says what is
absent and how to get it.

The benchmark feeds token ids, so llama.cpp's tokenizer is never used, only loaded. A byte-level
tokenizer the converter does not recognise (kvmesh's seeded and tiny checkpoints) is written with
the GPT-2 pre-tokenizer its ``ByteLevel`` regex is, and, having no merges, with one inert merge of
two special tokens, since llama.cpp loads no BPE vocab without merges. ``python -m
kvmesh.loadgen.llamacpp_runner`` runs the converter with those fallbacks, in its own process (the
converter puts its own folders on ``sys.path``).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

import numpy as np
import torch

CONVERTER_ENV = "KVMESH_LLAMA_CPP_CONVERTER"
# Where ``make bench-deps`` puts the converter: beside the virtual environment's other data.
DEFAULT_CONVERTER = Path(sys.prefix) / "share" / "kvmesh" / "llama.cpp" / "convert_hf_to_gguf.py"
GGUF_TYPES = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


class LlamaCppMissingError(RuntimeError):
    """What the llama.cpp comparison lacks, and the command that installs it."""


def converter_path(explicit: str | None = None) -> Path:
    """``explicit``, else ``$KVMESH_LLAMA_CPP_CONVERTER``, else where ``make bench-deps`` puts it."""
    return Path(explicit or os.environ.get(CONVERTER_ENV) or DEFAULT_CONVERTER)


def missing(converter: Path) -> list[str]:
    """What the comparison cannot run without (empty when everything is there)."""
    lacks = []
    if importlib.util.find_spec("llama_cpp") is None:
        lacks.append("the llama_cpp module (llama-cpp-python, built from source)")
    if not converter.is_file():
        lacks.append(f"llama.cpp's GGUF converter at {converter} (set {CONVERTER_ENV} or pass it)")
    elif (
        not (converter.parent / "conversion").is_dir()
        or not (converter.parent / "gguf-py").is_dir()
    ):
        lacks.append(f"the conversion/ and gguf-py/ folders beside {converter}")
    if importlib.util.find_spec("sentencepiece") is None:
        lacks.append("sentencepiece (the converter imports it for every Llama)")
    return lacks


def require(converter: Path, flag: str = "--against llama.cpp") -> None:
    """Raise ``LlamaCppMissingError`` naming every missing piece and ``make bench-deps``
    (``flag``: the option that asked for llama.cpp, as the message names it)."""
    lacks = missing(converter)
    if lacks:
        raise LlamaCppMissingError(
            f"{flag} needs " + "; ".join(lacks) + ". Install them with "
            "`make bench-deps` (builds llama-cpp-python from source: minutes)."
        )


def convert(
    hf_dir: Path, out: Path, dtype: torch.dtype, converter: Path, outtype: str | None = None
) -> Path:
    """Write ``hf_dir`` as a GGUF file of ``dtype`` weights at ``out`` (or of the converter's
    ``outtype``, e.g. "q8_0"); returns ``out``."""
    if outtype is None:
        if dtype not in GGUF_TYPES:
            raise ValueError(
                f"no GGUF type for {dtype}; kvmesh runs {sorted(map(str, GGUF_TYPES))}"
            )
        outtype = GGUF_TYPES[dtype]
    cmd = [sys.executable, "-m", __name__, str(converter), str(hf_dir), str(out), outtype]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0 or not out.is_file():
        tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
        raise RuntimeError(f"llama.cpp's converter failed on {hf_dir}:\n{tail}")
    return out


def _run_converter(converter: Path, hf_dir: str, out: str, outtype: str) -> None:
    """The converter's ``main`` with the GPT-2 pre-tokenizer as the fallback for unknown ones."""
    import runpy

    sys.path[:0] = [str(converter.parent), str(converter.parent / "gguf-py")]
    from conversion.base import TextModel  # the converter's package, found through sys.path

    known = TextModel.get_vocab_base_pre

    def pre_tokenizer(self: Any, tokenizer: Any) -> str:
        try:
            return known(self, tokenizer)
        except NotImplementedError:  # token ids are fed directly; the tokenizer only loads
            return "gpt-2"

    TextModel.get_vocab_base_pre = pre_tokenizer
    import gguf  # the converter's own gguf-py, first on sys.path

    add_to_gguf = gguf.SpecialVocab.add_to_gguf

    def with_merges(self: Any, gw: Any, quiet: bool = False) -> None:
        add_to_gguf(self, gw, quiet)
        if self.load_merges and not self.merges:
            # llama.cpp refuses a BPE vocab without merges; a byte-level tokenizer has none. One
            # pair of special tokens (split off before BPE, never merged) loads and changes nothing.
            gw.add_token_merges(["<|bos|> <|end|>"])

    gguf.SpecialVocab.add_to_gguf = with_merges
    sys.argv = [str(converter), hf_dir, "--outfile", out, "--outtype", outtype]
    runpy.run_path(str(converter), run_name="__main__")


class LlamaCppRunner:
    """One llama.cpp context, greedy. ``n_threads`` for prompt and generation alike; the KV cache
    in ``kv_type``: the weights' type keeps both engines at the same precision, f16 is
    llama.cpp's own default, ``"q8_0"`` its 8-bit KV (32 int8 values and an f16 scale a block; a
    quantized V needs ``flash_attn``). ``max_batch`` > 1: decode that many sequences in one
    ``llama_decode`` per step (``BatchedDecode``, as llama-server's parallel slots do), each
    with ``batch_ctx`` positions of its own (default ``n_ctx``)."""

    def __init__(
        self,
        gguf: Path,
        threads: int,
        n_ctx: int,
        kv_type: torch.dtype | str,
        flash_attn: bool = False,
        max_batch: int = 1,
        batch_ctx: int | None = None,
    ) -> None:
        import llama_cpp

        if isinstance(kv_type, str):
            name = kv_type.upper()
        else:
            name = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[kv_type]
        ggml_type = getattr(llama_cpp, f"GGML_TYPE_{name}", None)
        if ggml_type is None:
            raise ValueError(f"this llama-cpp-python has no {name} KV cache type")
        self.llm = llama_cpp.Llama(
            model_path=str(gguf),
            n_ctx=n_ctx,
            n_threads=threads,
            n_threads_batch=threads,
            type_k=ggml_type,
            type_v=ggml_type,
            flash_attn=flash_attn,
            verbose=False,
        )
        self._llama_cpp = llama_cpp
        self.n_vocab = self.llm.n_vocab()
        self.max_batch = max_batch
        self.batch_ctx = batch_ctx or n_ctx
        self._batched: BatchedDecode | None = None  # made on the first batch above one

    def _next_token(self) -> int:
        logits = self._llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def _prefill(self, prompt: list[int]) -> int:
        self.llm.reset()
        self.llm.eval(prompt)
        return self._next_token()

    def generate(
        self, prompts: list[list[int]], num_tokens: int, stop_token_ids: Collection[int] = ()
    ) -> list[list[int]]:
        """``num_tokens`` greedy tokens per prompt, fewer where one of ``stop_token_ids`` comes
        (kept as the last token)."""
        outputs = []
        for prompt in prompts:
            tokens = [self._prefill(prompt)]
            while len(tokens) < num_tokens and tokens[-1] not in stop_token_ids:
                self.llm.eval(tokens[-1:])
                tokens.append(self._next_token())
            outputs.append(tokens)
        return outputs

    def decode_step_times(
        self, prompts: list[list[int]], num_tokens: int, clock: Callable[[], float]
    ) -> list[float]:
        assert len(prompts) <= self.max_batch, (len(prompts), self.max_batch)
        if len(prompts) > 1:
            if self._batched is None:
                self._batched = BatchedDecode(self.llm, self.max_batch, self.batch_ctx)
            return self._batched.decode_step_times(prompts, num_tokens, clock)
        token = self._prefill(prompts[0])
        times = []
        for _ in range(num_tokens - 1):
            t0 = clock()
            self.llm.eval([token])
            token = self._next_token()
            times.append(clock() - t0)
        return times


class BatchedDecode:
    """A second llama.cpp context on ``llm``'s model (same threads and KV type) with room for
    ``max_batch`` sequences of ``n_ctx`` positions each: every prompt prefilled as its own
    sequence, then one ``llama_decode`` of one token per sequence a step, greedy."""

    def __init__(self, llm: Any, max_batch: int, n_ctx: int) -> None:
        import llama_cpp

        self._lib = llama_cpp
        params = type(llm.context_params).from_buffer_copy(llm.context_params)
        params.n_ctx = max_batch * -(-n_ctx // 256) * 256  # llama.cpp's padding: no rounding
        params.n_seq_max = max_batch
        self.n_batch = int(params.n_batch)
        self.ctx = llama_cpp.llama_init_from_model(llm.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context for {max_batch} sequences")
        self.batch = llama_cpp.llama_batch_init(max(self.n_batch, max_batch), 0, 1)
        self.n_vocab = llm.n_vocab()
        self._llm = llm  # the model outlives this context
        self.outputs: list[list[int]] = []  # the last run's greedy tokens, per sequence

    def __del__(self) -> None:
        lib = getattr(self, "_lib", None)
        if lib is not None and getattr(self, "ctx", None):
            lib.llama_batch_free(self.batch)
            lib.llama_free(self.ctx)

    def _decode(self, entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        b = self.batch
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        b.n_tokens = len(entries)
        rc = self._lib.llama_decode(self.ctx, b)
        if rc != 0:
            raise RuntimeError(f"llama_decode returned {rc}")

    def _argmax(self, i: int) -> int:
        logits = self._lib.llama_get_logits_ith(self.ctx, i)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def decode_step_times(
        self, prompts: list[list[int]], num_tokens: int, clock: Callable[[], float]
    ) -> list[float]:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.ctx), True)
        tokens = []
        for seq, prompt in enumerate(prompts):  # prefill, not timed
            for start in range(0, len(prompt), self.n_batch):
                chunk = prompt[start : start + self.n_batch]
                last = start + len(chunk) == len(prompt)
                self._decode(
                    [(t, start + j, seq, last and j == len(chunk) - 1) for j, t in enumerate(chunk)]
                )
            tokens.append(self._argmax(-1))
        lens = [len(p) for p in prompts]
        self.outputs = [[t] for t in tokens]
        times = []
        for step in range(num_tokens - 1):
            t0 = clock()
            self._decode([(t, lens[s] + step, s, True) for s, t in enumerate(tokens)])
            tokens = [self._argmax(s) for s in range(len(prompts))]
            times.append(clock() - t0)
            for out, t in zip(self.outputs, tokens, strict=True):
                out.append(t)
        return times


if __name__ == "__main__":
    _run_converter(Path(sys.argv[1]), *sys.argv[2:5])
