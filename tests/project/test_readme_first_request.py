"""The README's first request is the one a new user copies (issue 45: without temperature and
max_tokens the 135M model answered noise, and ran to 5,787 tokens): greedy, bounded, to the
model ``kvmesh up`` serves by default, with the answer it gives shown (that answer is checked on
the real model by test_real_model_quant's README question)."""

from __future__ import annotations

import json
import re

from support.doc_blocks import ROOT

from kvmesh.commands.up_config import UpConfig


def test_the_readmes_first_request_is_greedy_bounded_and_shows_its_answer() -> None:
    readme = (ROOT / "README.md").read_text()
    block = re.search(r"Try it once `make up` prints the URL:\n\n```bash\n(.*?)```", readme, re.S)
    assert block, "README: the first request's block moved"
    body = re.search(r"-d '(\{.*?\})'", block.group(1), re.S)
    assert body, block.group(1)
    request = json.loads(body.group(1))
    assert request["model"] == UpConfig().model
    assert request["temperature"] == 0 and 0 < request["max_tokens"] <= 64
    assert request["messages"][-1]["content"] == "What is the capital of France?"
    assert 'answers "The capital of France is Paris."' in block.group(1)
