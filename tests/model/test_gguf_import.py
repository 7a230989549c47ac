"""kvmesh model import on synthetic GGUF files (tests/support/gguf_fixtures.py): every tensor type the
issue names, against transformers' own GGUF loading; the tokenizer and chat template; the bad
files, each refused in one line."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from kvmesh.shared.model.gguf_file import GGUFError, read_gguf
from kvmesh.shared.model.gguf_import import MARKER, import_gguf, verify_import
from kvmesh.shared.model.gguf_weights import unpermute_rows
from kvmesh.shared.model.loader import load_model
from support.gguf_fixtures import CHAT_TEMPLATE, TYPES, llamacpp_permute, write_gguf

TEXTS = [
    "The capital of France is Paris.",
    "What is the quick brown fox? It jumps over the lazy dog.\n\n  indented",
    "<|im_start|>user\nhi<|im_end|>\n<think> done",
]


@pytest.fixture(scope="module")
def synthetic(tmp_path_factory) -> tuple[Path, Path, dict[str, np.ndarray]]:
    """(GGUF file, its import, its HF weights before quantization)."""
    root = tmp_path_factory.mktemp("gguf")
    weights = write_gguf(root / "synthetic.gguf")
    # every tensor dequantized: the checkpoint transformers reads too
    import_gguf(root / "synthetic.gguf", root / "imported", dequantize=True)
    return root / "synthetic.gguf", root / "imported", weights


@pytest.fixture(scope="module")
def transformers_gguf(synthetic):
    """transformers' own reading of the GGUF file: (model, tokenizer)."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path = synthetic[0]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    )
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.eval(), tokenizer


def test_file_holds_every_tensor_type_the_issue_names(synthetic) -> None:
    types = {t.type_name for t in read_gguf(synthetic[0]).tensors.values()}
    assert set(TYPES) <= types


def test_unpermute_rows_inverts_llamacpp_permutation() -> None:
    w = np.arange(8 * 64 * 3, dtype=np.float32).reshape(8 * 64, 3)
    for heads in (1, 2, 8):
        assert np.array_equal(unpermute_rows(llamacpp_permute(w, heads), heads), w)
    assert not np.array_equal(llamacpp_permute(w, 8), w)  # the test would see a no-op


def test_import_gives_transformers_gguf_weights_and_logits(synthetic, transformers_gguf) -> None:
    """The imported checkpoint holds the tensors transformers dequantizes from the same file
    (bit for bit), and kvmesh's model on it gives transformers' logits."""
    from safetensors.torch import load_file

    model, _ = transformers_gguf
    reference = model.state_dict()
    imported = load_file(str(synthetic[1] / "model.safetensors"))
    assert imported.keys() <= reference.keys()
    for name, tensor in imported.items():
        assert torch.equal(tensor, reference[name]), name
    ours, our_tokenizer = load_model(str(synthetic[1]))
    for text in TEXTS:
        ids = our_tokenizer.encode(text)
        with torch.no_grad():
            expected = model(torch.tensor([ids])).logits[0]
        torch.testing.assert_close(kvmesh_logits(ours, ids), expected, rtol=1e-4, atol=1e-4)


def kvmesh_logits(model, ids: list[int]) -> torch.Tensor:
    """Every position's logits from kvmesh's model, prefilled through a paged KV pool."""
    from kvmesh.shared.kv.kv_cache import KVPool
    from kvmesh.shared.model.llama import kv_cache_spec
    from support.hf_fixtures import BLOCK_SIZE, prefill_logits

    num_blocks = -(-len(ids) // BLOCK_SIZE)
    pool = KVPool(kv_cache_spec(model.config, BLOCK_SIZE), num_blocks)
    return prefill_logits(model, ids, pool, list(range(num_blocks)))


def test_quantized_weights_round_trip_within_their_format(synthetic) -> None:
    """Q and K rows come back in HF order and every tensor is its original within its type's
    rounding (a 4-bit block: 1/7 of its largest value). The K-quant tensors hold random blocks
    (gguf cannot quantize to them), checked against transformers above instead."""
    from kvmesh.shared.model.gguf_weights import hf_name
    from safetensors.torch import load_file

    source, directory, original = synthetic
    types = {hf_name(n): t.type_name for n, t in read_gguf(source).tensors.items()}
    step = {"F32": 0.0, "F16": 1e-3, "BF16": 8e-3, "Q8_0": 1 / 127, "Q4_0": 1 / 7, "Q4_1": 1 / 7}
    imported = load_file(str(directory / "model.safetensors"))
    checked = set()
    for name, values in original.items():
        if types[name] in ("Q4_K", "Q6_K"):
            continue
        bound = step[types[name]] * float(np.abs(values).max())
        err = (imported[name] - torch.from_numpy(values)).abs().max().item()
        assert err <= bound, (name, types[name], err, bound)
        checked.add(types[name])
    assert checked == set(step)
    assert types["model.layers.1.self_attn.q_proj.weight"] == "F32"  # permuted, then exact
    assert types["model.layers.0.self_attn.k_proj.weight"] == "BF16"


def test_tokenizer_matches_transformers_and_splits_digits_as_llamacpp(
    synthetic, transformers_gguf
) -> None:
    """Same ids as transformers' GGUF tokenizer on text without digits; digits one by one as
    llama.cpp's "smollm" pre-tokenizer splits them, where transformers (GPT-2 regex for every
    byte-level file) merges "12"."""
    from kvmesh.shared.text.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(synthetic[1])
    _, theirs = transformers_gguf
    for text in TEXTS:
        assert ours.encode(text) == theirs(text).input_ids, text
        assert ours.decode(ours.encode(text), skip_special_tokens=False) == text
    digits = ours.encode("12 2024", add_special_tokens=False)
    assert [ours.decode([i]) for i in digits] == ["1", "2", " ", "2", "0", "2", "4"]
    assert len(theirs("12 2024").input_ids) < len(digits)  # transformers merged them
    assert ours.encode("<think>", add_special_tokens=False) == [ours.token_to_id("<think>")]


def test_chat_template_and_special_tokens_match_transformers(synthetic, transformers_gguf) -> None:
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    config, ours = load_config_and_tokenizer(str(synthetic[1]))
    _, theirs = transformers_gguf
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    assert ours.chat_template == CHAT_TEMPLATE
    assert ours.apply_chat_template(messages) == theirs.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )
    assert config.eos_token_ids == (ours.token_to_id("<|im_end|>"),)
    assert ours.bos_token_id == ours.token_to_id("<|im_start|>") and not ours.add_bos_token
    assert config.tie_word_embeddings and config.vocab_size == ours.vocab_size


def test_import_writes_a_marker_with_every_files_hash_last(synthetic, tmp_path) -> None:
    directory = synthetic[1]
    marker = json.loads((directory / MARKER).read_text())
    assert set(marker["files"]) == {p.name for p in directory.iterdir()} - {MARKER}
    assert verify_import(directory, full=True) is not None
    copy = tmp_path / "copy"
    shutil.copytree(directory, copy)
    (copy / "config.json").write_text("{}")
    assert verify_import(copy) is not None  # sizes are not checked, only presence ...
    assert verify_import(copy, full=True) is None  # ... and hashes with full
    (copy / "tokenizer.json").unlink()
    assert verify_import(copy) is None


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_import_in_half_precision_loads_in_that_dtype(synthetic, tmp_path, dtype) -> None:
    import_gguf(synthetic[0], tmp_path / dtype, dtype, dequantize=True)
    model, _ = load_model(str(tmp_path / dtype))
    assert {p.dtype for p in model.parameters()} == {getattr(torch, dtype)}
    assert json.loads((tmp_path / dtype / "config.json").read_text())["torch_dtype"] == dtype


# --- bad files: one clear line each ----------------------------------------------------------


def _refused(source: Path, directory: Path) -> str:
    with pytest.raises(GGUFError) as info:
        import_gguf(source, directory)
    message = str(info.value)
    assert "\n" not in message and (str(source) in message or str(directory) in message)
    assert not directory.exists()  # nothing half-written left behind
    assert not list(directory.parent.glob(f".{directory.name}.partial-*"))
    return message


def test_truncated_file_is_refused(synthetic, tmp_path) -> None:
    data = synthetic[0].read_bytes()
    for keep in (len(data) - 100, len(data) // 2, 40):
        cut = tmp_path / f"cut-{keep}.gguf"
        cut.write_bytes(data[:keep])
        message = _refused(cut, tmp_path / f"out-{keep}")
        assert f"truncated file: it ends ({keep} bytes)" in message, message


def test_not_a_gguf_is_refused(tmp_path) -> None:
    path = tmp_path / "model.gguf"
    path.write_bytes(b"PK\x03\x04 not a gguf at all" * 10)
    assert "not a readable GGUF file" in _refused(path, tmp_path / "out")


def test_other_architecture_is_refused(tmp_path) -> None:
    write_gguf(tmp_path / "gpt2.gguf", arch="gpt2")
    message = _refused(tmp_path / "gpt2.gguf", tmp_path / "out")
    assert "unsupported architecture 'gpt2'" in message and "llama" in message


def test_tensor_type_gguf_cannot_dequantize_is_refused(tmp_path) -> None:
    """An I32 tensor where a weight belongs: gguf reads it but cannot dequantize it."""
    path = tmp_path / "i32.gguf"
    write_gguf(path, types=("F32", "I32"))
    message = _refused(path, tmp_path / "out")
    assert "has type I32, which the gguf package cannot dequantize" in message, message


def test_tensor_with_no_place_in_a_llama_is_refused(tmp_path) -> None:
    path = tmp_path / "moe.gguf"
    write_gguf(path, extra_tensors={"blk.0.ffn_gate_inp.weight": np.zeros((4, 256), np.float32)})
    message = _refused(path, tmp_path / "out")
    assert "'blk.0.ffn_gate_inp.weight'" in message and "not a plain Llama" in message


def test_other_vocabulary_kinds_are_refused_before_the_weights(tmp_path) -> None:
    write_gguf(tmp_path / "bert.gguf", tokenizer_model="bert")
    message = _refused(tmp_path / "bert.gguf", tmp_path / "out")
    assert "tokenizer 'bert' is not supported" in message and "SentencePiece" in message


def test_unknown_pre_tokenizer_is_refused_by_name(tmp_path) -> None:
    write_gguf(tmp_path / "pre.gguf", pre="mystery-bpe")
    assert "pre-tokenizer 'mystery-bpe'" in _refused(tmp_path / "pre.gguf", tmp_path / "out")


def test_rope_freqs_is_refused(tmp_path) -> None:
    path = tmp_path / "rope.gguf"
    write_gguf(path, extra_tensors={"rope_freqs.weight": np.ones(32, np.float32)})
    assert "rope_freqs" in _refused(path, tmp_path / "out")


def test_existing_folder_is_not_overwritten(synthetic, tmp_path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(GGUFError, match="not an empty folder"):
        import_gguf(synthetic[0], tmp_path / "out")
    assert (tmp_path / "out" / "keep.txt").read_text() == "mine"


def test_cli_import_prints_the_directory_and_refuses_in_one_line(synthetic, tmp_path) -> None:
    import subprocess
    import sys

    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvmesh.cli",
            "model",
            "import",
            str(synthetic[0]),
            str(tmp_path / "x"),
        ],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0 and f"wrote {tmp_path / 'x'}" in out.stdout, out.stderr
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"nope")
    out = subprocess.run(
        [sys.executable, "-m", "kvmesh.cli", "model", "import", str(bad), str(tmp_path / "y")],
        capture_output=True,
        text=True,
    )
    assert out.returncode == 1
    assert out.stderr.strip().count("\n") == 0 and "kvmesh model import:" in out.stderr


# --- SentencePiece vocabularies (Llama 2, Mistral, TinyLlama) --------------------------------

SPM_TEXTS = ["The capital of France is Paris.", "Été à Paris 🙂 12 2024\nnew line"]


@pytest.fixture(scope="module")
def sentencepiece(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("spm")
    write_gguf(root / "spm.gguf", tokenizer_model="llama", pre="default")
    import_gguf(root / "spm.gguf", root / "imported")
    return root / "spm.gguf", root / "imported"


def test_sentencepiece_tokenizer_matches_transformers_on_plain_text(sentencepiece) -> None:
    """Merges from the scores, byte fallback for what the vocabulary lacks (é, the emoji), BOS
    added: transformers' GGUF tokenizer gives the same ids and both decode to the text."""
    transformers = pytest.importorskip("transformers")
    from kvmesh.shared.text.tokenizer import Tokenizer

    path, directory = sentencepiece
    ours = Tokenizer.from_pretrained(directory)
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in SPM_TEXTS:
        ids = ours.encode(text)
        assert ids == theirs(text).input_ids, text
        assert ids[0] == ours.bos_token_id and ours.decode(ids) == text
    assert ours.token_to_id("<0xF0>") in ours.encode("🙂")  # not in the vocabulary: bytes


def test_sentencepiece_prefixes_every_text_piece_with_a_space_as_llamacpp(sentencepiece) -> None:
    """llama.cpp (and SentencePiece's dummy prefix) put "▁" before every piece of text, also
    one that starts with spaces or follows a special token; transformers' Llama tokenizer
    prepends it only at the start, and not before a space. kvmesh follows llama.cpp."""
    from kvmesh.shared.text.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(sentencepiece[1])
    space = ours.token_to_id("▁")
    assert ours.encode("  two", add_special_tokens=False)[:3] == [space] * 3
    after_special = ours.encode("</s>hi there", add_special_tokens=False)
    assert after_special == [ours.token_to_id("</s>"), *ours.encode("hi there", False)]


def test_sentencepiece_tokenizer_matches_llamacpp(sentencepiece) -> None:
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is installed by make bench-deps"
    )
    from kvmesh.shared.text.tokenizer import Tokenizer

    path, directory = sentencepiece
    ours = Tokenizer.from_pretrained(directory)
    llm = llama_cpp.Llama(str(path), vocab_only=True, verbose=False)
    for text in [*SPM_TEXTS, "  two leading spaces", "</s> after a special <think> token"]:
        expected = llm.tokenize(text.encode(), add_bos=True, special=True)
        assert ours.encode(text) == expected, text


def test_sentencepiece_model_loads_and_gives_transformers_logits(sentencepiece) -> None:
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    path, directory = sentencepiece
    reference = transformers.AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32
    ).eval()
    model, tokenizer = load_model(str(directory))
    ids = tokenizer.encode(SPM_TEXTS[0])
    with torch.no_grad():
        expected = reference(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(kvmesh_logits(model, ids), expected, rtol=1e-4, atol=1e-4)


# --- weights as stored ------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stored(synthetic, tmp_path_factory) -> Path:
    """The synthetic GGUF imported by default: F16, BF16, Q8_0, Q4_0, Q4_1, Q4_K and Q6_K
    weights kept as stored (F32 dequantized)."""
    directory = tmp_path_factory.mktemp("stored") / "imported"
    imported = import_gguf(synthetic[0], directory)
    assert not imported.is_dequantized and verify_import(directory).is_dequantized is False
    return directory


def test_default_import_keeps_stored_formats_and_dequantizes_the_rest(synthetic, stored) -> None:
    from kvmesh.shared.model.gguf_weights import hf_name
    from kvmesh.shared.model.quant import CHECKPOINT_KEY, STORED_FORMATS
    from safetensors import safe_open

    types = {hf_name(n): t.type_name for n, t in read_gguf(synthetic[0]).tensors.items()}
    with safe_open(str(stored / "model.safetensors"), "pt") as f:
        formats = json.loads(f.metadata()[CHECKPOINT_KEY])
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}  # noqa: SIM118
    expected = {
        n: t for n, t in types.items() if t in STORED_FORMATS and not n.endswith("norm.weight")
    }
    assert formats == expected and set(expected.values()) == set(TYPES) - {"F32"}
    assert all((dtypes[n] == torch.uint8) == (n in formats) for n in dtypes)
    assert (stored / "model.safetensors").stat().st_size < (
        synthetic[1] / "model.safetensors"
    ).stat().st_size


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "float32"])
def test_auto_kv_is_float16_over_stored_weights_for_the_engine_and_the_store_alike(
    synthetic, stored, kv_cache_dtype
) -> None:
    """ "auto" KV: float16 for a float32 model whose weights are kept as stored (llama.cpp's f16
    default), float32 for the dequantized import; the KV store, which reads no weights, gets the
    engine's layout from the checkpoint's headers. ``float32`` pins float32 over stored weights."""
    from kvmesh.services.kv_store.layout import store_layout
    from kvmesh.shared.engine.config import EngineConfig
    from kvmesh.shared.engine.llm_engine import LLMEngine

    expected = {stored: torch.float16 if kv_cache_dtype == "auto" else torch.float32}
    expected[synthetic[1]] = torch.float32
    for directory, dtype in expected.items():
        model, tokenizer = load_model(str(directory))
        config = EngineConfig(num_blocks=2, kv_cache_dtype=kv_cache_dtype, cpu_kernels=False)
        engine = LLMEngine(model, tokenizer, config)
        spec, kv_spec = store_layout(str(directory), None, 16, kv_cache_dtype)
        assert engine.kv_pool.spec.dtype == spec.dtype == dtype, directory
        assert kv_spec == engine.kv_spec


def test_stored_weights_load_as_the_dequantized_values(synthetic, stored) -> None:
    from kvmesh.shared.model.quant import dequantize
    from kvmesh.shared.model.quant_layers import QuantEmbedding, QuantLinear

    float_model, _ = load_model(str(synthetic[1]))
    model, _ = load_model(str(stored))
    quant = [m for m in model.modules() if isinstance(m, (QuantLinear, QuantEmbedding))]
    assert quant  # the test would pass on a model with none
    floats = dict(float_model.named_parameters())
    for name, module in model.named_modules():
        if isinstance(module, (QuantLinear, QuantEmbedding)) and not name.endswith(".head"):
            assert torch.equal(dequantize(module.qweight), floats[f"{name}.weight"]), name
    assert dict(model.named_parameters()).keys() < floats.keys()
    dequantized, _ = load_model(str(stored), dequantize=True)
    for name, param in dequantized.named_parameters():
        assert torch.equal(param, floats[name]), name


def test_stored_weights_give_the_dequantized_models_logits(synthetic, stored) -> None:
    from kvmesh.kernels.cpu_ops import load_cpu_ops
    from kvmesh.shared.model.backend import CpuBackend

    float_model, tokenizer = load_model(str(synthetic[1]))
    model, _ = load_model(str(stored))
    ids = tokenizer.encode("The capital of France is Paris, and the capital of Spain is Madrid.")
    expected = kvmesh_logits(float_model, ids)
    torch.testing.assert_close(kvmesh_logits(model, ids), expected, rtol=1e-4, atol=1e-4)
    ops = load_cpu_ops()
    if ops is None:
        return
    CpuBackend(ops).install(model)  # the kernels: activations quantized to int8 per block of 32
    got = kvmesh_logits(model, ids)
    assert (got - expected).norm() / expected.norm() < 0.05
    assert (got.argmax(-1) == expected.argmax(-1)).float().mean() >= 0.9


def test_stored_weights_do_not_keep_the_file_mapped(stored) -> None:
    """Each weight kept as stored owns its bytes: a view into the memory-mapped safetensors file
    kept the whole mapping, and every page the load read through it, resident beside the copies
    (SmolLM2's engine: 201 MB of RSS for the model, 154 MB without)."""
    import gc

    model, _ = load_model(str(stored))  # alive through the check: its tensors would hold it
    gc.collect()
    maps = Path("/proc/self/maps")
    if not maps.exists():
        pytest.skip("no /proc/self/maps here")
    target = str((stored / "model.safetensors").resolve())
    assert not [line for line in maps.read_text().splitlines() if line.endswith(target)]
    del model
