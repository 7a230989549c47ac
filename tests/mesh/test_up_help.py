"""``kvmesh up --help``: examples that parse, one default per flag, flags grouped by the service
they set (issue 45: no examples, "(default: from --model…) (default: None; env …)", one group
titled "UpConfig (env: KVMESH_<FIELD>)")."""

from __future__ import annotations

import argparse
import dataclasses
import re
import shlex

from kvmesh.shared.config.service_config import config_from_args, flag_name

from kvmesh.commands import up
from kvmesh.commands.up_config import FLAG_GROUPS, UpConfig


def _up_parser() -> argparse.ArgumentParser:
    sub = argparse.ArgumentParser(prog="kvmesh").add_subparsers()
    up.register(sub)
    return sub.choices["up"]


def _help_of_each_flag(parser: argparse.ArgumentParser) -> dict[str, str]:
    return {
        action.option_strings[0]: action.help or ""
        for action in parser._actions
        if action.option_strings and action.dest != "help"
    }


def test_every_example_in_up_help_is_a_valid_command() -> None:
    parser = _up_parser()
    text = parser.format_help()
    examples = re.findall(r"^  (kvmesh up\b.*?)(?:\s+#.*)?$", text, re.MULTILINE)
    assert len(examples) >= 5, text
    for example in examples:
        argv = shlex.split(example)[2:]
        config = config_from_args(UpConfig, parser.parse_args(argv), env={})
        assert isinstance(config, UpConfig), example
    assert any("--tool-call-parser" in e for e in examples)


def test_each_flag_states_its_default_once_and_its_variable() -> None:
    helps = _help_of_each_flag(_up_parser())
    assert len(helps) == len(dataclasses.fields(UpConfig))
    for field in dataclasses.fields(UpConfig):
        text = helps[flag_name(field.name)]
        assert text.count("default") <= 1, text
        assert "default: None" not in text and "default: ()" not in text, text
        assert f"env KVMESH_{field.name.upper()})" in text, text
        if field.default not in (None, ()) and "default:" not in field.metadata["help"]:
            shown = field.default
            if isinstance(shown, bool):
                shown = "on" if shown else "off"
            assert f"(default: {shown}; env" in text, text


def test_flags_are_grouped_by_the_service_they_set() -> None:
    parser = _up_parser()
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert titles[1:] == [title for title, _ in FLAG_GROUPS]  # after argparse's own (--help)
    grouped = [name for _, names in FLAG_GROUPS for name in names]
    assert sorted(grouped) == sorted(f.name for f in dataclasses.fields(UpConfig))
    text = parser.format_help()
    assert "UpConfig" not in text and "<FIELD>" not in text
    assert "router (kvmesh serve router):\n  --port" in text
