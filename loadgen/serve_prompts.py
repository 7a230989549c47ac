"""The prompts ``kvmesh bench serve`` sends (the same for every target): exact token lengths
made with the served model's tokenizer (random tokens or text cut from a corpus), a ShareGPT
``--dataset``'s, or a ``--trace``'s with its arrival times; each rate of a sweep the first
rate's lengths with text of its own, and the untimed warm-ups."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Sequence
from typing import Any

from kvmesh.loadgen.bench_serve_config import ServeBenchConfig
from kvmesh.loadgen.workload import WorkloadPrompt


def build_workload(config: ServeBenchConfig) -> tuple[list[WorkloadPrompt], list[float] | None]:
    """The prompts (same for every target) and, for a trace, its arrival times."""
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    model_config, tokenizer = load_config_and_tokenizer(config.tokenizer or config.model)
    return _prompts(config, model_config, tokenizer, random.Random(f"{config.seed}:prompts"))


def rate_prompts(
    config: ServeBenchConfig, first: Sequence[WorkloadPrompt]
) -> list[Sequence[WorkloadPrompt]]:
    """Each rate's prompts: the first rate sends ``first``; every later rate of a sweep the same
    lengths (and output lengths) in the same order, with other text (drawn from a seed of the
    rate's index), so that no server answers a later rate from the prefix cache the earlier ones
    filled. A trace or a dataset sends the same prompts at every rate, as before."""
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    rates = config.request_rates
    if len(rates) < 2 or config.trace is not None or config.dataset is not None:
        return [first] * len(rates)
    model_config, tokenizer = load_config_and_tokenizer(config.tokenizer or config.model)
    out: list[Sequence[WorkloadPrompt]] = [first]
    for index in range(1, len(rates)):
        lengths_rng = random.Random(f"{config.seed}:prompts")
        text_rng = random.Random(f"{config.seed}:prompts:rate{index}")
        prompts, _ = _prompts(config, model_config, tokenizer, lengths_rng, text_rng)
        out.append(prompts)
    return out


def build_warmups(
    config: ServeBenchConfig, prompts: Sequence[WorkloadPrompt], is_trace: bool
) -> list[WorkloadPrompt]:
    """``--warmups`` untimed prompts of at most 8 output tokens: drawn like the workload's, from a
    seed of their own (so no measured prompt is cached by them), or for a trace or a dataset the
    first prompt, as before."""
    from kvmesh.shared.model.checkpoint_info import load_config_and_tokenizer

    if not config.num_warmups:
        return []
    if is_trace or config.dataset is not None:
        drawn = [prompts[0]] * config.num_warmups
    else:
        model_config, tokenizer = load_config_and_tokenizer(config.tokenizer or config.model)
        rng = random.Random(f"{config.seed}:warmups")
        warm = dataclasses.replace(config, num_prompts=config.num_warmups)
        drawn, _ = _prompts(warm, model_config, tokenizer, rng)
    return [dataclasses.replace(p, output_len=min(p.output_len, 8)) for p in drawn]


def _prompts(
    config: ServeBenchConfig,
    model_config: Any,
    tokenizer: Any,
    rng: random.Random,
    text_rng: random.Random | None = None,
) -> tuple[list[WorkloadPrompt], list[float] | None]:
    """Prompt lengths from ``rng``, their text (or token ids) from ``text_rng`` where given, else
    from ``rng`` as it stands after the lengths."""
    from kvmesh.loadgen import arrivals, workload
    from kvmesh.loadgen.corpus import DEFAULT_CORPUS, Corpus

    as_text = config.endpoint_path == "/v1/chat/completions" or config.prompt_format == "text"
    if config.trace is not None:
        records = arrivals.load_trace(config.trace)[: config.num_prompts]
        lengths = [(r.input_len, r.output_len) for r in records]
        prompts = workload.random_prompts(tokenizer, lengths, rng, as_text=as_text)
        return prompts, arrivals.trace_arrival_times(records)
    num = config.num_prompts or 100
    if config.dataset is not None:
        pairs = workload.load_sharegpt(config.dataset)
        return workload.sharegpt_prompts(
            tokenizer, pairs, num, rng, output_len=config.output_len
        ), None
    output_lens = workload.LengthSpec.parse(config.output_len or 64, config.output_len_range)
    input_lens = config.input_lengths().fit_context(
        model_config.max_position_embeddings, output_lens.high
    )
    lengths = workload.sample_lengths(
        num,
        input_lens,
        output_lens,
        rng,
        long_input_len=config.long_input_len,
        long_fraction=config.long_fraction,
    )
    text_rng = rng if text_rng is None else text_rng
    if config.prompt_source == "corpus":
        corpus = Corpus.load(tokenizer, config.corpus or DEFAULT_CORPUS)
        return corpus.prompts(tokenizer, lengths, text_rng), None
    return workload.random_prompts(tokenizer, lengths, text_rng, as_text=as_text), None
