"""``kvmesh bench serve``'s workload presets, length distributions, corpus prompts and SLO
attainment sweep, end to end against the fake OpenAI server of test_loadgen_sse_client.py."""

from __future__ import annotations

import argparse
import importlib.util
import statistics

import orjson
import pytest
from kvmesh.loadgen.bench_serve_flags import add_arguments, config_from_args
from kvmesh.loadgen.corpus import DEFAULT_CORPUS
from kvmesh.loadgen.slo_attainment import SloObjective
from kvmesh.shared.model.tiny import tiny_tokenizer
from test_loadgen_sse_client import fake_openai_server

from kvmesh.cli import main

HAS_MATPLOTLIB = importlib.util.find_spec("matplotlib") is not None


def bench(url: str, *flags: str) -> int:
    return main(["bench", "serve", "--base-url", url, "--tokenizer", "kvmesh-tiny", *flags])


def config(*flags: str):
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--model", "kvmesh-tiny", *flags])
    return config_from_args(args)


@pytest.fixture
def server():
    with fake_openai_server(ttft_s=0.01, gap_s=0.005) as fake:
        yield fake


def test_longtail_preset_is_the_outside_testers_workload():
    c = config("--workload", "longtail")
    assert (c.input_len_dist, c.input_len, c.input_len_sd, c.input_len_range) == (
        "normal",
        1500,
        700.0,
        "128:4800",
    )
    assert (c.prompt_source, c.prompt_format, c.endpoint_path) == (
        "corpus",
        "text",
        "/v1/completions",
    )
    assert (c.output_len, c.ignore_eos, c.num_prompts, c.num_warmups) == (96, True, 40, 2)
    assert (c.arrival, c.burstiness, c.request_rates) == ("gamma", 0.5, (0.4,))


def test_flags_given_win_over_the_preset_and_builtins_fill_the_rest():
    c = config(
        "--workload", "longtail", "--num-prompts", "12", "--burstiness", "1", "--arrival", "poisson"
    )
    assert (c.num_prompts, c.arrival, c.burstiness, c.input_len_sd) == (12, "poisson", 1.0, 700.0)
    plain = config()
    assert (plain.input_len, plain.input_len_dist, plain.arrival, plain.num_warmups) == (
        128,
        "uniform",
        "poisson",
        1,
    )
    assert (plain.prompt_source, plain.prompt_format, plain.request_rates) == (
        "random",
        "ids",
        (float("inf"),),
    )


def test_longtail_sends_corpus_text_of_clipped_normal_lengths_after_two_warmups(server, tmp_path):
    result = tmp_path / "r.json"
    flags = ["--model", "ok", "--workload", "longtail", "--num-prompts", "30", "--output-len", "3"]
    assert bench(server.url, *flags, "--request-rate", "200", "--result-json", str(result)) == 0
    tokenizer = tiny_tokenizer()
    corpus = DEFAULT_CORPUS.read_text()
    warmups, sent = server.bodies[:2], server.bodies[2:]
    assert len(sent) == 30 and all(b["ignore_eos"] and b["stream"] for b in server.bodies)
    lengths = []
    for body in sent:
        assert isinstance(body["prompt"], str) and body["prompt"][:100] in corpus + corpus
        lengths.append(len(tokenizer.encode(body["prompt"], add_special_tokens=False)))
    assert all(128 <= n <= 4800 for n in lengths)
    assert 1000 < statistics.fmean(lengths) < 2000 and statistics.pstdev(lengths) > 300
    assert {b["prompt"] for b in warmups}.isdisjoint(b["prompt"] for b in sent)
    assert all(b["max_tokens"] == 3 for b in warmups)
    run = orjson.loads(result.read_bytes())["runs"][0]
    assert [r["prompt_len"] for r in run["requests"]] == lengths  # no warm-up among them


def test_lognormal_lengths_are_clipped_to_the_models_context(server):
    flags = ["--model", "ok", "--input-len-dist", "lognormal", "--input-len", "3000"]
    flags += ["--input-len-sd", "3000", "--input-len-range", "16:100000", "--output-len", "96"]
    assert bench(server.url, *flags, "--num-prompts", "30", "--warmups", "0") == 0
    lengths = [len(b["prompt"]) for b in server.bodies]
    assert max(lengths) == 4096 - 96  # kvmesh-tiny's context less the output


def test_slo_sweep_writes_attainment_per_rate_and_scale_and_goodput(server, tmp_path, capsys):
    out = tmp_path / "slo"
    flags = ["--model", "ok", "--num-prompts", "4", "--input-len", "16", "--output-len", "4"]
    flags += ["--slo-sweep", "100,200", "--slo-base", "ttft_ms=2000,tpot_ms=1000,gap_ms=1000"]
    saved = tmp_path / "result.json"
    assert (
        bench(
            server.url, *flags, "--slo-dir", str(out), "--cores", "2", "--result-json", str(saved)
        )
        == 0
    )
    body = orjson.loads((out / "slo_sweep.json").read_bytes())
    assert body["base"] == {"ttft_ms": 2000.0, "tpot_ms": 1000.0, "gap_p99_ms": 1000.0}
    assert {(p["rate"], p["scale"]) for p in body["attainment"]} == {
        (r, s) for r in (100.0, 200.0) for s in ("tight", "medium", "loose")
    }
    assert all(p["attainment"] == 1.0 for p in body["attainment"])  # the fake is fast
    assert body["goodput"][0] == {
        "label": "run",
        "scale": "tight",
        "goodput": 200.0,
        "per_core": 100.0,
    }
    assert "SLO attainment" in capsys.readouterr().out
    if HAS_MATPLOTLIB:
        assert (out / "slo_attainment.png").read_bytes()[:4] == b"\x89PNG"
    # the same requests judged again under a gap-only objective no stream can meet: nothing sent
    again = tmp_path / "again"
    judge = ["bench", "serve", "--slo-judge", str(saved), "--slo-dir", str(again)]
    assert main([*judge, "--slo-base", "gap_ms=0.001"]) == 0
    body = orjson.loads((again / "slo_sweep.json").read_bytes())
    assert body["base"] == {"ttft_ms": None, "tpot_ms": None, "gap_p99_ms": 0.001}
    assert body["cores"] == 2 and all(p["attainment"] == 0.0 for p in body["attainment"])
    assert "SLO attainment (p99 gap <= 0.001 ms" in capsys.readouterr().out
    saved.write_text("{}")
    assert main(judge) == 2
    assert "not a bench serve --result-json file" in capsys.readouterr().err


def test_each_rate_of_a_sweep_sends_the_same_lengths_with_text_of_its_own(server, tmp_path):
    """No rate is served from the prefix cache an earlier rate filled: same lengths, other text."""
    flags = ["--model", "ok", "--workload", "longtail", "--num-prompts", "6", "--output-len", "2"]
    flags += ["--warmups", "0", "--slo-sweep", "300,400", "--slo-dir", str(tmp_path)]
    assert bench(server.url, *flags) == 0
    first, second = server.bodies[:6], server.bodies[6:]
    assert len(second) == 6
    tokenizer = tiny_tokenizer()

    def lengths(bodies):
        return sorted(len(tokenizer.encode(b["prompt"], add_special_tokens=False)) for b in bodies)

    assert lengths(first) == lengths(second)
    assert {b["prompt"] for b in first}.isdisjoint(b["prompt"] for b in second)


def test_slo_sweep_counts_slow_requests_as_missed(tmp_path):
    with fake_openai_server(ttft_s=0.3, gap_s=0.005) as slow:
        flags = ["--model", "ok", "--num-prompts", "3", "--input-len", "16", "--output-len", "3"]
        flags += ["--slo-sweep", "100", "--slo-base", "ttft_ms=500,tpot_ms=1000,gap_ms=1000"]
        assert bench(slow.url, *flags, "--slo-dir", str(tmp_path), "--warmups", "0") == 0
    body = orjson.loads((tmp_path / "slo_sweep.json").read_bytes())
    shares = {p["scale"]: p["attainment"] for p in body["attainment"]}
    assert shares == {
        "tight": 0.0,
        "medium": 1.0,
        "loose": 1.0,
    }  # tight 250 ms < TTFT (>= 300) < medium 500
    goodput = {g["scale"]: g["goodput"] for g in body["goodput"]}
    assert goodput == {"tight": None, "medium": 100.0, "loose": 100.0}


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--slo-sweep", "1", "--request-rate", "2"], "--slo-sweep gives the request rates"),
        (["--slo-sweep", "1", "--slo-base", "ttft_ms=-1"], "--slo-base ttft_ms: a limit"),
        (["--slo-scales", "1,2"], "three scales"),
        (["--input-len-dist", "normal"], "needs --input-len-sd"),
        (
            ["--input-len-dist", "normal", "--input-len-sd", "5", "--input-len-range", "0.2"],
            "MIN:MAX",
        ),
        (["--input-len-sd", "5"], "applies to normal and lognormal"),
        (["--cores", "0"], "--cores"),
    ],
)
def test_bad_workload_and_sweep_flags_exit_2_with_a_message(flags, message, capsys):
    assert bench("http://127.0.0.1:9", *flags) == 2
    assert message in capsys.readouterr().err


def test_the_base_objective_reaches_the_config():
    c = config("--slo-sweep", "0.2,0.4", "--slo-base", "ttft_ms=3000,tpot_ms=50,gap_ms=250")
    assert c.slo_base == SloObjective(3000, 50, 250) and c.request_rates == (0.2, 0.4)
    assert config().slo_base is None
