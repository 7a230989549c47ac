"""Draft settings: DraftConfig's checks, and what `kvmesh up --draft` starts."""

from __future__ import annotations

import pytest
from kvmesh.services.draft.config import DraftConfig

from kvmesh.commands.up_config import UpConfig
from kvmesh.commands.up_plan import plan


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"num_speculative_tokens": 17}, "num_speculative_tokens must be in"),
        ({"num_speculative_tokens": 2, "tree": (4, 4, 4)}, "has 3 depths"),
        ({"num_speculative_tokens": 3, "tree": (4, 4, 4)}, "limit is 63"),
        ({"method": "early-exit", "num_speculative_tokens": 3, "tree": (4, 4, 4)}, "limit is 63"),
        ({"method": "model"}, "needs --draft-model"),
        ({"ngram_min": 3, "ngram_max": 2}, "ngram_min and ngram_max"),
        ({"lookahead": 18}, "lookahead must be in"),
        ({"max_sequences": 0}, "max_sequences must be >= 1"),
    ],
)
def test_draft_config_refuses_bad_settings(kwargs, error):
    with pytest.raises(ValueError, match=error):
        DraftConfig(**kwargs)


def test_drafted_shape_continues_the_tree_with_the_lookahead():
    config = DraftConfig(num_speculative_tokens=3, tree=(2, 2, 1), lookahead=2)
    assert config.drafted_shape.widths == (2, 2, 1, 1, 1)
    assert not config.uses_data_plane and config.role == "draft"


def test_default_lookahead_covers_three_verify_steps_for_ngram_and_one_for_models():
    assert DraftConfig(num_speculative_tokens=4).drafted_shape.depth == 4 + 15
    assert DraftConfig(num_speculative_tokens=8).drafted_shape.depth == 8 + 17  # at most 17
    early = DraftConfig(method="early-exit", num_speculative_tokens=4)
    assert early.drafted_shape.depth == 4 + 5


def test_up_with_draft_starts_draft_workers_and_speculative_decode():
    config = UpConfig(
        draft="ngram", draft_workers=2, num_speculative_tokens=3, draft_tree=(2, 1, 1), cores=8
    )
    specs = {s.name: s for s in plan(config, "nats://127.0.0.1:4222", 8000)}
    assert "--speculative" in specs["decode-0"].argv
    for name in ("draft-0", "draft-1"):
        argv = specs[name].argv
        assert argv[:2] == ("serve", "draft") and specs[name].tier == "draft"
        assert argv[argv.index("--method") + 1] == "ngram"
        assert argv[argv.index("--tree") + 1] == "2,1,1"
        assert argv[argv.index("--num-speculative-tokens") + 1] == "3"


def test_up_with_early_exit_has_prefill_write_the_draft_kv_over_the_mesh_transport():
    config = UpConfig(draft="early-exit", draft_exit_layer=2, transport="tcp", cores=8)
    specs = {s.name: s for s in plan(config, "nats://127.0.0.1:4222", 8000)}
    assert "--draft-kv" in specs["prefill-0"].argv
    argv = specs["draft-0"].argv
    assert argv[argv.index("--transport") + 1] == "tcp"
    assert argv[argv.index("--exit-layer") + 1] == "2"
    assert DraftConfig(method="early-exit").uses_data_plane
    ngram = {s.name: s for s in plan(UpConfig(draft="ngram"), "nats://127.0.0.1:4222", 8000)}
    assert "--draft-kv" not in ngram["prefill-0"].argv


def test_up_with_a_draft_model_has_prefill_run_it_for_the_draft_kv():
    config = UpConfig(draft="model", draft_model="/ckpt/draft", transport="tcp", cores=8)
    specs = {s.name: s for s in plan(config, "nats://127.0.0.1:4222", 8000)}
    argv = specs["prefill-0"].argv
    assert "--draft-kv" in argv and argv[argv.index("--draft-model") + 1] == "/ckpt/draft"
    argv = specs["draft-0"].argv
    assert argv[argv.index("--transport") + 1] == "tcp"
    assert argv[argv.index("--draft-model") + 1] == "/ckpt/draft"
    assert DraftConfig(method="model", draft_model="/ckpt/draft").uses_data_plane
    assert not DraftConfig(method="ngram").uses_data_plane


def test_up_without_draft_starts_no_draft_worker():
    specs = plan(UpConfig(), "nats://127.0.0.1:4222", 8000)
    assert not any(s.tier == "draft" for s in specs)
    assert all("--speculative" not in s.argv for s in specs)


def test_up_refuses_a_bad_draft_tree_in_one_line():
    with pytest.raises(ValueError, match="has 2 depths"):
        UpConfig(draft="ngram", num_speculative_tokens=3, draft_tree=(2, 2))
