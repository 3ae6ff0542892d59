"""``colocd … --help`` documents every option and shows what an option left out means."""

from __future__ import annotations

import argparse
from collections.abc import Iterator

import pytest

from colocd.cli import build_parser


def _commands(parser: argparse.ArgumentParser, name: str = "colocd") -> Iterator[tuple[str, argparse.ArgumentParser]]:
    yield name, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub_name, sub in action.choices.items():
                yield from _commands(sub, f"{name} {sub_name}")


COMMANDS = dict(_commands(build_parser()))


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_every_option_has_help_and_its_default_is_shown(command: str) -> None:
    parser = COMMANDS[command]
    text = "".join(parser.format_help().split())  # help wraps at spaces and hyphens
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        assert action.help, f"{command}: {action.dest} has no help text"
        if action.option_strings and action.nargs != 0 and not action.required:
            if action.default is None:  # what leaving it out means must be said in words
                assert "(default" in action.help, f"{command}: {action.dest} does not say what unset means"
            else:
                shown = "".join(f"(default: {action.default})".split())
                assert shown in text, f"{command}: {action.dest}'s default is not shown"


def test_the_daemon_reading_commands_share_their_options() -> None:
    for command in ("colocd status", "colocd top", "colocd trace", "colocd policy apply"):
        dests = {a.dest for a in COMMANDS[command]._actions}
        assert {"url", "token", "timeout"} <= dests, command
