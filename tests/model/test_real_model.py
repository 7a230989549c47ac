"""The real default model, SmolLM2-135M-Instruct (kvmesh model fetch smollm2-135m-instruct):
its import against transformers' own GGUF loading, its tokenizer and chat template against
transformers' (and llama.cpp's, where llama-cpp-python is installed), `kvmesh up` with its
defaults answering chats as transformers does, greedy, token for token, and the official openai
client's tool round trip (a small agent loop) through the mesh in both modes.

The model is fetched once per machine into kvmesh's cache (about 10 s from the package index,
640 MB); where the index cannot be reached these tests skip and say so. A minute or two in all.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from support.gguf_reference import parsed_once
from support.tool_specs import WEATHER, WEATHER_TOOL

NAME = "smollm2-135m-instruct"
GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TEXTS = [
    "The capital of France is",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "Hello,   world!\n\nÉté à Paris — naïve café 你好 🙂",
    "<|im_start|>user\nhi<|im_end|>\n",
]
CHATS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "List three primary colors.",
]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def real_model() -> Path:
    from kvmesh.shared.model.fetch import IndexUnreachableError, fetch_model

    try:
        return fetch_model(NAME, progress=lambda line: print(f"[real model] {line}"))
    except IndexUnreachableError as e:
        pytest.skip(f"{NAME} is not cached and cannot be fetched: {e}")


@pytest.fixture(scope="module")
def real_model_float(real_model, tmp_path_factory) -> Path:
    """The same GGUF imported with every weight dequantized to float32 (``--dequantize``): the
    checkpoint transformers reads, and kvmesh's float path."""
    from kvmesh.shared.model.gguf_import import import_gguf

    directory = tmp_path_factory.mktemp("float") / NAME
    import_gguf(real_model / GGUF, directory, dequantize=True)
    return directory


@pytest.fixture(scope="module")
def transformers_gguf(real_model, tmp_path_factory):
    """transformers' own reading of the GGUF the import started from: (model, tokenizer). From
    a folder holding only the GGUF, so that nothing the import wrote is read."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    alone = tmp_path_factory.mktemp("gguf-alone")
    (alone / GGUF).symlink_to(real_model / GGUF)
    with parsed_once():  # the same model and tokenizer, the GGUF parsed once (support/)
        model = transformers.AutoModelForCausalLM.from_pretrained(
            alone, gguf_file=GGUF, dtype=torch.float32
        )
        tokenizer = transformers.AutoTokenizer.from_pretrained(alone, gguf_file=GGUF)
    return model.eval(), tokenizer


def test_import_holds_transformers_gguf_tensors_and_gives_its_logits(
    real_model_float, transformers_gguf
) -> None:
    from kvmesh.shared.model.loader import load_model
    from safetensors.torch import load_file
    from test_gguf_import import kvmesh_logits

    reference, _ = transformers_gguf
    state = reference.state_dict()
    for name, tensor in load_file(str(real_model_float / "model.safetensors")).items():
        assert torch.equal(tensor, state[name]), name
    model, tokenizer = load_model(str(real_model_float))
    for text in TEXTS[:3]:
        ids = tokenizer.encode(text)
        with torch.no_grad():
            expected = reference(torch.tensor([ids])).logits[0]
        got = kvmesh_logits(model, ids)
        torch.testing.assert_close(got, expected, rtol=1e-3, atol=2e-3)
        assert torch.equal(got.argmax(-1), expected.argmax(-1)), text


def test_tokenizer_and_chat_template_match_transformers(real_model, transformers_gguf) -> None:
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    config, ours = load_config_and_tokenizer(str(real_model))
    _, theirs = transformers_gguf
    for text in TEXTS:  # no run of digits: there transformers' GGUF tokenizer differs (below)
        assert ours.encode(text) == theirs(text).input_ids, text
    for chat in CHATS:
        messages = [{"role": "user", "content": chat}]
        expected = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert ours.apply_chat_template(messages) == expected
    assert ours.vocab_size == config.vocab_size == 49152
    assert config.eos_token_ids == (ours.token_to_id("<|im_end|>"),)
    assert (config.num_hidden_layers, config.num_attention_heads) == (30, 9)
    assert config.num_key_value_heads == 3 and config.tie_word_embeddings


def test_tokenizer_matches_llamacpp_including_digits(real_model) -> None:
    """llama.cpp's own tokenizer on the same GGUF (its "smollm" pre-tokenizer splits every
    digit, as SmolLM's tokenizer.json does; transformers' GGUF tokenizer does not)."""
    llama_cpp = pytest.importorskip(
        "llama_cpp", reason="llama-cpp-python is installed by make bench-deps"
    )
    from kvmesh.shared.text.tokenizer import Tokenizer

    ours = Tokenizer.from_pretrained(real_model)
    llm = llama_cpp.Llama(str(real_model / GGUF), vocab_only=True, verbose=False)
    for text in [*TEXTS, "In 2024, 1,234,567 people paid $12.50 each (3.14159)."]:
        expected = llm.tokenize(text.encode(), add_bos=False, special=True)
        assert ours.encode(text, add_special_tokens=False) == expected, text


def _transformers_answers(directory: Path) -> list[str]:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    answers = []
    for chat in CHATS:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": chat}], add_generation_prompt=True, return_tensors="pt"
        )
        ids = ids if torch.is_tensor(ids) else ids["input_ids"]
        with torch.no_grad():
            out = model.generate(
                ids, max_new_tokens=MAX_TOKENS, do_sample=False, eos_token_id=2, pad_token_id=2
            )
        answers.append(tokenizer.decode(out[0, ids.shape[1] :], skip_special_tokens=True))
    return answers


async def _ask(url: str) -> list[str]:
    import aiohttp

    async def one(session, chat: str) -> str:
        body = {
            "model": NAME,
            "messages": [{"role": "user", "content": chat}],
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
        }
        async with session.post(f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return (await resp.json())["choices"][0]["message"]["content"]

    async with aiohttp.ClientSession() as session:
        return list(await asyncio.gather(*(one(session, c) for c in CHATS)))


@pytest.fixture(scope="module")
def up_mesh(real_model_float, tmp_path_factory) -> Iterator[str]:
    """`kvmesh up` serving the model's float32 import under its name, disaggregated with every
    prompt prefilled remotely (its KV moved to the decode worker): the router's URL."""
    from kvmesh.shared.config.ports import free_port

    port, nats = free_port(), f"nats://127.0.0.1:{free_port()}"
    argv = [sys.executable, "-m", "kvmesh.cli", "up", "--port", str(port), "--nats-url", nats]
    argv += ["--model", str(real_model_float), "--served-model-name", NAME]
    argv += ["--local-prefill-threshold", "0", "--log-level", "warning"]
    logs = tmp_path_factory.mktemp("up")
    out, err = logs / "up.out", logs / "up.err"
    with out.open("wb") as fout, err.open("wb") as ferr:
        proc = subprocess.Popen(argv, stdout=fout, stderr=ferr)
    try:
        deadline = time.monotonic() + 180
        while "kvmesh is up" not in out.read_text():
            assert proc.poll() is None, err.read_text()
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.5)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.send_signal(2)
        proc.wait(60)


@pytest.fixture(scope="module")
def float_answers(real_model_float) -> list[str]:
    """transformers' greedy answers to CHATS on the float32 import."""
    return _transformers_answers(real_model_float)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_kvmesh_up_answers_chats_as_transformers(up_mesh, float_answers) -> None:
    """Through the mesh, the greedy answers equal transformers' on the same weights. (The
    default, the Q4_1 weights as stored with int8 activations, computes something slightly
    different: tests/model/test_real_model_quant.py.)"""
    answers = asyncio.run(_ask(up_mesh))
    assert answers == float_answers
    assert "Paris" in answers[0]  # a trained model, not noise


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("prefill_tp", "decode_tp"), [(2, 1), (1, 2)], ids=["2to1", "1to2"])
def test_tensor_parallel_meshes_answer_chats_as_transformers(
    real_model_float, float_answers, prefill_tp: int, decode_tp: int
) -> None:
    """``kvmesh up --prefill-tp 2`` (and ``--decode-tp 2``) on the real model: every prompt
    prefilled remotely, each prefill rank writing its heads (2 + 1 of the 3 KV heads) straight
    into the decode rank(s) that hold them (docs/tp.md); the greedy answers are transformers'
    (and so TP1's, above). In float32, where TP's other summation order moves logits by about
    1e-6, far below these answers' margins; on the Q4_1 weights near-ties can part (docs/tp.md)."""
    from kvmesh.testing.mesh import launched, mesh_config

    config = mesh_config(
        model=str(real_model_float),
        served_model_name=NAME,
        prefill_tp=prefill_tp,
        decode_tp=decode_tp,
        local_prefill_threshold=0,
    )
    with launched(config) as launcher:
        answers = asyncio.run(_ask(launcher.url))
    assert answers == float_answers


@pytest.fixture(scope="module")
def colocated_mesh(real_model_float) -> Iterator[str]:
    """The same model served colocated (``kvmesh up --mode colocated``: one worker prefills and
    decodes every prompt, no KV moves): the router's URL."""
    from kvmesh.testing.mesh import launched, mesh_config

    config = mesh_config(model=str(real_model_float), served_model_name=NAME, mode="colocated")
    with launched(config) as launcher:
        yield launcher.url


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("mesh", ["up_mesh", "colocated_mesh"], ids=["disagg", "colocated"])
def test_a_small_agent_loop_runs_on_the_real_model_through_the_mesh(request, mesh: str) -> None:
    """The official client's tool round trip (issue 45), greedy and a few tokens each, in both
    modes: the model calls the tool (``required``: arguments held to its schema), gets its answer
    back as a ``role: "tool"`` message, and answers in words from it (``auto``, read by the
    template's parser); the streamed named call gives the same arguments in deltas."""
    import openai
    from jsonschema import Draft202012Validator

    url = request.getfixturevalue(mesh)
    tools = [WEATHER_TOOL]
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    messages: list[dict] = [{"role": "user", "content": "What is the weather in Paris?"}]
    asked = client.chat.completions.create(
        model=NAME,
        messages=messages,
        tools=tools,
        tool_choice="required",
        max_tokens=32,
        temperature=0,
    )
    (called,) = asked.choices
    (call,) = called.message.tool_calls
    arguments = json.loads(call.function.arguments)
    Draft202012Validator(WEATHER["parameters"]).validate(arguments)
    assert called.finish_reason == "tool_calls" and call.function.name == "get_weather"
    assert arguments["city"] == "Paris"  # a trained model reads the question
    messages.append(called.message.model_dump(exclude_none=True))
    weather = {"temperature": 18, "unit": "celsius", "sky": "sunny"}
    messages.append({"role": "tool", "tool_call_id": call.id, "content": json.dumps(weather)})
    answered = client.chat.completions.create(
        model=NAME, messages=messages, tools=tools, max_tokens=12, temperature=0
    )
    (final,) = answered.choices
    assert final.finish_reason == "stop" and not final.message.tool_calls
    assert "sunny" in final.message.content  # from the tool's answer, not the question
    named = {"type": "function", "function": {"name": "get_weather"}}
    stream = client.chat.completions.create(
        model=NAME,
        messages=messages[:1],
        tools=tools,
        tool_choice=named,
        max_tokens=32,
        temperature=0,
        stream=True,
    )
    streamed, finish = "", None
    for chunk in stream:
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            streamed += "".join(d.function.arguments or "" for d in choice.delta.tool_calls or ())
    assert finish == "tool_calls" and json.loads(streamed) == arguments


@pytest.mark.slow
def test_bench_serve_finds_every_process_of_the_mesh_by_role(up_mesh) -> None:
    """What ``kvmesh bench serve --base-url`` counts the CPU of (issue 45: the router alone)."""
    from kvmesh.loadgen.mesh_processes import server_roles

    roles = server_roles(up_mesh)
    assert set(roles) == {"router", "prefill", "decode", "kv-registry", "prefill-queue", "nats"}
    assert all(len(pids) == 1 for pids in roles.values())


@pytest.mark.slow
def test_tp2_holds_2_and_1_of_its_3_gqa_groups_decodes_and_hands_off_as_tp1(real_model) -> None:
    """TP2 over the weights as stored (Q4_1): 9 heads and 3 KV heads split by whole GQA
    groups, rank 0 KV heads 0-1 with query heads 0-5, rank 1 KV head 2 with 6-8 (docs/tp.md);
    both ranks' greedy tokens are TP1's (a 20-token prompt, 8 tokens). The prompt counts, so
    that every greedy step wins by more than 3 logits: the weights' int8 activation rows make
    TP's other summation order move logits by tenths at times (docs/tp.md); a chat's 64-token
    answer is held to TP1's up to its near-ties (``_answers_as_tp1_until_it_hesitates``). Then
    the prompt prefilled at TP1 or TP2 and decoded at TP1 or TP2 (2 -> 1, 1 -> 2, 2 -> 2;
    1 -> 1 is ``kvmesh up``'s own, above), each prefill rank writing its heads with the
    product's planners: TP1's tokens."""
    import multiprocessing as mp

    from kvmesh.shared.config.ports import free_port
    from kvmesh.shared.model.loader import load_model
    from support import tp_ranks

    model, tokenizer = load_model(str(real_model))
    prompt = tokenizer.encode(", ".join(str(i) for i in range(1, 12)))[:20]  # "1, 2, ..., 7,"
    assert len(prompt) == 20
    ctx = mp.get_context("spawn")
    queue, port = ctx.Queue(), free_port()
    chat = tokenizer.encode_chat([{"role": "user", "content": CHATS[2]}])
    args = (port, queue, str(real_model), prompt, 8, chat, CHAT_TOKENS)
    procs = [ctx.Process(target=tp_ranks.pair_main, args=(r, *args), daemon=True) for r in (0, 1)]
    for proc in procs:
        proc.start()
    try:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # one core for TP1 while the ranks start on their own
        try:
            expected = tp_ranks.greedy(model, prompt, 8)
            tp1 = tp_ranks.scored(model, chat, CHAT_TOKENS)
        finally:
            torch.set_num_threads(threads)
        ranks = dict(queue.get(timeout=480) for _ in procs)  # a loaded box, kernels to build
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    assert [(ranks[r]["kv_heads"], ranks[r]["q"]) for r in (0, 1)] == [
        ((0, 2), (0, 6)),
        ((2, 3), (6, 9)),
    ]
    assert ranks[0]["tokens"] == ranks[1]["tokens"] == expected
    _answers_as_tp1_until_it_hesitates(model, chat, tp1, ranks[0]["chat"], ranks[1]["chat"])
    # the prompt handed off 2 -> 1, 1 -> 2 and 2 -> 2 through the product's planners (2 blocks
    # of 16 tokens, 2 chunks): each decode rank gets its heads of both blocks (2 + 1 at TP2,
    # each from the prefill rank holding them) and decodes TP1's tokens
    # K and V, 30 layers, 16 tokens, head_dim 64, float16 ("auto" KV over the weights as stored)
    head_bytes = 2 * 30 * 16 * 64 * 2
    held = {1: [3], 2: [2, 1]}  # KV heads a rank holds at TP1, TP2
    senders = {"2_to_1": [[0, 1]], "1_to_2": [[0], [0]], "2_to_2": [[0], [1]]}
    for name, (prefill, decode) in tp_ranks.PAIR_HANDOFFS.items():
        for d, r in enumerate(decode):
            run = ranks[r][name]
            assert run["tokens"] == expected[: tp_ranks.MAX_TOKENS], name
            assert run["received"] == 2 * head_bytes * held[len(decode)][d], name
            assert run["senders"] == senders[name][d], name
        for p, r in enumerate(prefill):  # its heads, once: no decode rank holds one twice
            assert ranks[r][name]["sent"] == 2 * head_bytes * held[len(prefill)][p], name


CHAT_TOKENS = 64
# logits: decode on the weights as stored moves a step's log-probabilities at TP2 by up to 0.15
# (measured: 0.146 on CHATS[2]; 0.000 on the float32 import), prefill by under 0.001
DECODE_SHIFT, PREFILL_SHIFT = 0.3, 0.01
HESITANT = 0.05  # a top-2 margin below it is a near-tie (issue 41's line for formats)


def _answers_as_tp1_until_it_hesitates(model, chat, tp1, *tp2) -> None:
    """A chat's greedy answer on the weights as stored at TP2 (every rank's) against TP1's.
    Decode quantizes each layer's input into int8 rows of 32 values, so the all-reduce's other
    order of float sums can round an activation to the next step, and the logits move by up to
    tenths: the answers are held equal while TP1's margin is above twice the largest move seen,
    and every step on their common path within it. Prefill (float rows) is held closer: TP2's
    whole answer scored at TP1 in one prefill (teacher forcing) has TP2's top token wherever
    TP1's margin is not a near-tie."""
    from support import tp_ranks

    def margin(top: tuple[tuple[int, ...], tuple[float, ...]]) -> float:
        return top[1][0] - top[1][1]

    def shift(a, b) -> float:
        return abs(a[1][0] - b[1][0])

    tokens = tp2[0]["tokens"]
    assert tokens == tp2[1]["tokens"]
    until = next((i for i, s in enumerate(tp1["steps"]) if margin(s) < DECODE_SHIFT), CHAT_TOKENS)
    assert tokens[:until] == tp1["tokens"][:until]
    same = next(
        (i for i, (a, b) in enumerate(zip(tp1["tokens"], tokens, strict=True)) if a != b),
        CHAT_TOKENS,
    )
    moved = max(
        shift(a, b) for a, b in zip(tp1["steps"][:same], tp2[0]["steps"][:same], strict=True)
    )
    at_tp1 = tp_ranks.teacher(model, chat + tokens)
    answer = slice(len(chat) - 1, None)  # the positions that score the answer's tokens
    pairs = list(zip(at_tp1[answer], tp2[0]["teacher"][answer], strict=True))
    sure = [(a, b) for a, b in pairs if margin(a) >= HESITANT]
    scored = max(shift(a, b) for a, b in pairs if a[0][0] == b[0][0])
    print(
        f"TP2's answer is TP1's for {same} of {CHAT_TOKENS} tokens (TP1's first margin under "
        f"{DECODE_SHIFT}: step {until}), log-probabilities moved <= {moved:.3f}; teacher-forced, "
        f"{sum(a[0][0] == b[0][0] for a, b in pairs)}/{len(pairs)} top tokens agree, moved <= "
        f"{scored:.4f}"
    )
    assert moved <= DECODE_SHIFT
    assert all(a[0][0] == b[0][0] for a, b in sure)
    assert scored <= PREFILL_SHIFT
