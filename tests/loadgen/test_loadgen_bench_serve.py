"""``kvmesh bench serve`` end to end against the fake OpenAI server of test_loadgen_sse_client.py:
flags, JSON results, plots, seeds, traces, datasets; and the comparison table's arithmetic."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import sys
from pathlib import Path

import orjson
import pytest
from kvmesh.loadgen.bench_serve_flags import parse_cpus
from kvmesh.loadgen.progress import ProgressBar
from kvmesh.loadgen.serve_metrics import RequestRecord, summarize
from kvmesh.loadgen.serve_outputs import long_prompt_threshold
from kvmesh.loadgen.serve_report import RunResult, format_comparison
from test_loadgen_sse_client import fake_openai_server

from kvmesh.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def bench(url: str, *flags: str) -> int:
    argv = ["bench", "serve", "--base-url", url, "--tokenizer", "kvmesh-tiny", *flags]
    return main(argv)


@pytest.fixture
def server():
    with fake_openai_server(ttft_s=0.01, gap_s=0.005) as fake:
        yield fake


def test_bench_serve_sweep_writes_json_plots_and_counts_failures(server, tmp_path, capsys):
    result = tmp_path / "out" / "result.json"
    flags = ["--model", "flaky", "--num-prompts", "6", "--input-len", "16"]
    flags += ["--input-len-range", "8:32", "--output-len", "4", "--request-rate", "200,inf"]
    flags += ["--slo", "ttft_ms=5000,itl_ms=5000", "--result-json", str(result)]
    if HAS_MATPLOTLIB:
        flags += ["--plot-dir", str(tmp_path / "plots")]
    assert bench(server.url, *flags) == 0
    body = orjson.loads(result.read_bytes())
    assert [run["request_rate"] for run in body["runs"]] == [200.0, "inf"]
    for run in body["runs"]:
        summary = run["summary"]
        # "flaky" answers every third request (the warm-up is the first) with HTTP 429
        assert summary["failures"] == {"http_429": 2}
        assert (summary["num_requests"], summary["num_completed"]) == (6, 4)
        assert summary["num_good"] == 4 and summary["goodput"] > 0
        assert summary["total_output_tokens"] == 16
        ok = [r for r in run["requests"] if r["error"] is None]
        assert len(ok) == 4 and all(len(r["chunk_times"]) == 4 for r in ok)
    assert body["config"]["request_rates"] == [200.0, "inf"]
    sent = [b["prompt"] for b in server.bodies[1:]]  # after the warm-up
    assert len(sent) == 12 and all(8 <= len(p) <= 32 for p in sent)
    # every rate sends the same lengths, each with prompts of its own (no prefix-cache hits)
    assert sorted(map(len, sent[:6])) == sorted(map(len, sent[6:])) and sent[:6] != sent[6:]
    out = capsys.readouterr().out
    assert "failures: http_429 2" in out and "inf req/s" in out
    if HAS_MATPLOTLIB:
        names = sorted(p.name for p in (tmp_path / "plots").iterdir())
        assert names == [
            "goodput_vs_rate.png",
            "latency_cdf_rate-200.png",
            "latency_cdf_rate-inf.png",
            "token_gaps_rate-200.png",
            "token_gaps_rate-inf.png",
            "ttft_stages_rate-200.png",  # the fake server's and the load generator's CPU
            "ttft_stages_rate-inf.png",
        ]
        assert all((tmp_path / "plots" / n).read_bytes()[:8] == PNG_MAGIC for n in names)


def test_compare_loads_outside_servers_in_turn_with_the_table(server, tmp_path, capsys):
    result = tmp_path / "compare.json"
    targets = f"first={server.url},second={server.url}"
    flags = ["--model", "ok", "--num-prompts", "3", "--output-len", "3", "--warmups", "0"]
    assert bench(server.url, "--compare", targets, *flags, "--result-json", str(result)) == 0
    out = capsys.readouterr().out
    assert "==== first @ inf req/s" in out and "==== second @ inf req/s" in out
    assert "second/first" in out  # the table, each target against the first
    assert "CPU by role" in out and "loadgen" in out and "server" in out  # found by its port
    runs = orjson.loads(result.read_bytes())["runs"]
    assert [r["label"] for r in runs] == ["first", "second"]
    breakdown = runs[0]["ttft_breakdown"]
    assert breakdown["num_requests"] == 0  # no kvmesh router: no stages, only roles
    assert breakdown["roles"]["server"]["cpu_s"] >= 0


def prompts_and_arrivals(url: str, server, tmp_path, seed: int, *flags: str):
    start = len(server.bodies)
    result = tmp_path / f"seed{seed}.json"
    flags = ("--model", "ok", "--num-prompts", "5", "--output-len", "2", *flags)
    assert bench(url, *flags, "--request-rate", "50", "--seed", str(seed), "--warmups", "0",
                 "--result-json", str(result)) == 0  # fmt: skip
    bodies = sorted(server.bodies[start:], key=lambda b: str(b))
    run = orjson.loads(result.read_bytes())["runs"][0]
    return bodies, [r["arrival_s"] for r in run["requests"]]


def test_same_seed_repeats_prompts_and_arrivals_exactly(server, tmp_path):
    first = prompts_and_arrivals(server.url, server, tmp_path, 7)
    again = prompts_and_arrivals(server.url, server, tmp_path, 7)
    other = prompts_and_arrivals(server.url, server, tmp_path, 8)
    assert first == again
    assert first[0] != other[0] and first[1] != other[1]


def test_chat_endpoint_sends_text_of_the_asked_length(server, tmp_path):
    from kvmesh.shared.model.tiny import tiny_tokenizer

    bodies, _ = prompts_and_arrivals(
        server.url, server, tmp_path, 1, "--endpoint", "/v1/chat/completions", "--input-len", "40"
    )
    tokenizer = tiny_tokenizer()
    for body in bodies:
        text = body["messages"][0]["content"]
        assert len(tokenizer.encode(text, add_special_tokens=False)) == 40


def test_trace_replays_lengths_and_timestamps(server, tmp_path):
    trace = tmp_path / "trace.jsonl"
    rows = [(5.0, 12, 3), (5.05, 30, 2), (5.1, 7, 4)]
    trace.write_text(
        "".join(
            orjson.dumps({"timestamp": t, "input_len": n, "output_len": m}).decode() + "\n"
            for t, n, m in rows
        )
    )
    result = tmp_path / "trace.json"
    flags = ["--model", "ok", "--trace", str(trace), "--warmups", "0"]
    assert bench(server.url, *flags, "--result-json", str(result)) == 0
    run = orjson.loads(result.read_bytes())["runs"][0]
    assert run["request_rate"] is None
    assert [r["arrival_s"] for r in run["requests"]] == pytest.approx([0.0, 0.05, 0.1])
    assert [(len(b["prompt"]), b["max_tokens"]) for b in server.bodies] == [
        (n, m) for _, n, m in rows
    ]


def test_sharegpt_dataset_sends_the_conversation_prompts(server, tmp_path):
    data = [
        {"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "an answer"}]}
        for q in ("first question here", "second question here")
    ]
    path = tmp_path / "sharegpt.json"
    path.write_bytes(orjson.dumps(data))
    flags = ["--model", "ok", "--dataset", str(path), "--num-prompts", "2", "--warmups", "0"]
    assert bench(server.url, *flags, "--prompt-format", "text") == 0
    assert sorted(b["prompt"] for b in server.bodies) == [
        "first question here",
        "second question here",
    ]
    assert {b["max_tokens"] for b in server.bodies} == {len("an answer")}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--trace", "t.jsonl", "--request-rate", "1"], "leave out --request-rate"),
        (["--compare", "colocated,turbo"], "expected colocated or disagg, a URL or NAME=URL"),
        (["--compare", "disagg,disagg"], "names a target twice"),
        (["--compare", "disagg=http://x:1"], "a name that is not a mode"),
        (["--compare", "a=ftp://x"], "http(s)://HOST:PORT"),
        (["--colocated-budgets", "512,8"], "below one block"),
        (
            ["--compare", "disagg", "--model", "no/such/dir"],
            "--model 'no/such/dir': not 'kvmesh-tiny', a checkpoint directory, a .gguf file",
        ),
        (["--slo", "ttft=1"], "SLO"),
        (["--request-rate", "0"], "request rate"),
        (["--burstiness", "2"], "burstiness applies to gamma"),
        (["--input-len-range", "9:3"], "length range"),
        (["--extra-body", "[1]"], "JSON object"),
    ],
)
def test_bad_flags_exit_2_with_a_message(flags, message, capsys):
    assert bench("http://127.0.0.1:9", *flags) == 2
    assert message in capsys.readouterr().err


def test_failed_warmup_exits_1_and_says_why(server, capsys):
    assert bench(server.url, "--model", "rate-limited", "--num-prompts", "2") == 1
    err = capsys.readouterr().err
    assert "warm-up request" in err and "http_429" in err


def test_building_the_cli_parser_imports_no_client_or_plot_library():
    code = (
        "import sys; from kvmesh.cli import build_parser; build_parser(); "
        "print(sorted(m for m in ('aiohttp', 'matplotlib', 'torch') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def summary_of(ttft_s: float, gap_s: float, failed: int = 0):
    chunks = (ttft_s, ttft_s + gap_s, ttft_s + 2 * gap_s)
    ok = [RequestRecord(i, 0.0, 0.0, chunks[-1], 8, 3, 3, chunks) for i in range(2)]
    bad = [RequestRecord(9, 0.0, 0.0, 0.1, 8, 3, 0, (), error="timeout")] * failed
    return summarize(ok + bad, duration_s=1.0)


def test_comparison_table_gives_each_mode_and_the_ratio_to_the_first():
    results = [
        RunResult("colocated", 4.0, summary_of(0.1, 0.05), ()),
        RunResult("disagg", 4.0, summary_of(0.2, 0.01, failed=1), ()),
    ]
    table = format_comparison(results).splitlines()
    assert table[0].split()[:6] == ["rate", "mode", "p50", "TTFT", "ms", "p99"]
    colocated, disagg, ratio = (line.split() for line in table[1:])
    assert colocated[:5] == ["4", "req/s", "colocated", "100.00", "100.00"]
    assert disagg[2:5] == ["disagg", "200.00", "200.00"] and disagg[-1] == "1"
    assert ratio[0] == "disagg/colocated"
    assert ratio[1:6] == ["2.00x", "2.00x", "0.20x", "0.20x", "1.00x"]
    assert ratio[7] == "-"  # failures: no ratio to zero


def test_long_prompt_threshold_marks_only_a_mix_of_lengths():
    assert long_prompt_threshold([16, 16, 16, 512], None) == 32
    assert long_prompt_threshold([16, 16, 20], None) is None
    assert long_prompt_threshold([16, 16], 100) == 100
    assert long_prompt_threshold([], None) is None


def test_parse_cpus_reads_lists_and_ranges():
    assert parse_cpus("0-3,8") == frozenset({0, 1, 2, 3, 8})
    assert parse_cpus("") == frozenset()
    for bad in ("a", "3-1", "-2"):
        with pytest.raises(ValueError, match="--mesh-cpus"):
            parse_cpus(bad)


def test_progress_bar_prints_a_line_per_tenth_off_a_terminal():
    stream = io.StringIO()
    bar = ProgressBar(20, "run @ 1 req/s", stream=stream)
    for i in range(20):
        bar.update(RequestRecord(i, 0.0, 0.0, 0.1, 8, 3, 3, error="timeout" if i < 3 else None))
    bar.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[-1].startswith("run @ 1 req/s [" + "=" * 30 + "] 20/20, 3 failed")


def test_plots_without_matplotlib_fail_up_front_with_the_install_command(monkeypatch, capsys):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real_find_spec(name, *a),
    )
    assert bench("http://127.0.0.1:9", "--plot-dir", "plots") == 2
    assert "pip install 'kvmesh[bench]'" in capsys.readouterr().err


def test_without_model_it_asks_the_server_which_it_serves(server):
    flags = ["--num-prompts", "2", "--input-len", "8", "--output-len", "2"]
    assert bench(server.url, *flags) == 0
    assert {b["model"] for b in server.bodies} == {"served-fake"}


def test_a_server_that_does_not_answer_v1_models_is_named(capsys):
    assert main(["bench", "serve", "--base-url", "http://127.0.0.1:9", "--num-prompts", "1"]) == 2
    assert "/v1/models" in capsys.readouterr().err


@pytest.fixture
def cached_models(monkeypatch):
    """fetch_model answering from a cache that holds every fetchable model (kvmesh-tiny's
    weights stand in); the names asked for, in order."""
    asked: list[str] = []

    def fetch_model(name, progress=lambda _: None):
        asked.append(name)
        return Path("kvmesh-tiny")

    monkeypatch.setattr("kvmesh.shared.model.fetch.fetch_model", fetch_model)
    return asked


def test_the_served_model_resolves_from_the_cache_as_kvmesh_up_resolves_it(cached_models):
    from kvmesh.commands.up_config import UpConfig
    from kvmesh.commands.up_model import DEFAULT_MODEL, resolve_up_model

    flags = ["--num-prompts", "2", "--input-len", "8", "--output-len", "2"]
    with fake_openai_server(ttft_s=0.01, gap_s=0.005, model_id=DEFAULT_MODEL) as fake:
        assert main(["bench", "serve", "--base-url", fake.url, *flags]) == 0  # no --tokenizer
    assert {b["model"] for b in fake.bodies} == {DEFAULT_MODEL}
    assert resolve_up_model(UpConfig()).model == "kvmesh-tiny"
    assert cached_models == [DEFAULT_MODEL, DEFAULT_MODEL]  # bench serve's, then up's


def test_a_served_model_kvmesh_cannot_load_asks_for_a_tokenizer(server, capsys):
    assert main(["bench", "serve", "--base-url", server.url, "--num-prompts", "1"]) == 2
    err = capsys.readouterr().err
    assert "the served model 'served-fake'" in err and "--tokenizer DIR" in err


def test_compare_meshes_load_a_fetchable_model_as_kvmesh_up_does(
    cached_models, monkeypatch, capsys
):
    from kvmesh.loadgen import bench_serve

    def config_from_args(args):
        raise ValueError(f"the meshes would load {args.model}")

    monkeypatch.setattr(bench_serve, "config_from_args", config_from_args)
    argv = ["bench", "serve", "--compare", "colocated,disagg", "--model", "smollm2-135m-instruct"]
    assert main(argv) == 2
    assert cached_models == ["smollm2-135m-instruct"]
    assert "the meshes would load kvmesh-tiny" in capsys.readouterr().err  # the cache's path
