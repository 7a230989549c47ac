"""kvmesh bench spec's drafting configurations: chains per method, trees for --tree-methods."""

from kvmesh.loadgen.bench_spec import DraftSetup, draft_setups


def test_tree_methods_also_run_as_the_tree():
    setups = draft_setups("ngram,early-exit", 4, "2,2,1", "ngram,early-exit", exit_layer=2)
    assert setups == [
        DraftSetup("ngram", 4, exit_layer=2),
        DraftSetup("ngram", 3, (2, 2, 1), exit_layer=2),
        DraftSetup("early-exit", 4, exit_layer=2),
        DraftSetup("early-exit", 3, (2, 2, 1), exit_layer=2),
    ]


def test_default_tree_methods_leave_early_exit_a_chain():
    setups = draft_setups("ngram,early-exit", 4, "2,2,1,1", "ngram", exit_layer=1)
    assert [(s.method, s.tree) for s in setups] == [
        ("ngram", ()),
        ("ngram", (2, 2, 1, 1)),
        ("early-exit", ()),
    ]
    assert draft_setups("early-exit", 4, "", "early-exit", exit_layer=1) == [
        DraftSetup("early-exit", 4, exit_layer=1)
    ]


def test_draft_setups_model_method_carries_its_draft_model():
    setups = draft_setups("ngram,model", 4, "", "", exit_layer=1, draft_model="/ckpt/small")
    assert setups == [
        DraftSetup("ngram", 4, exit_layer=1),
        DraftSetup("model", 4, exit_layer=1, draft_model="/ckpt/small"),
    ]
