"""Shared argparse pieces for the subcommands (a leaf module: the stages import it, it imports none).

Experiment switches and diagnostics go in each subcommand's advanced group: `--help` lists only
what a user needs; `--help-advanced` lists everything.
"""
from __future__ import annotations

import argparse

ADVANCED = "advanced"


class _ShowAdvanced(argparse.Action):
    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        for action in parser._actions:
            if hasattr(action, "_advanced_help"):
                action.help = action._advanced_help
        parser.print_help()
        parser.exit()


class AdvancedGroup:
    """An argument group whose options `--help` hides and `--help-advanced` shows."""

    def __init__(self, parser: argparse.ArgumentParser, description: str):
        self._group = parser.add_argument_group(
            ADVANCED, f"{description} (listed by --help-advanced)")
        parser.add_argument("--help-advanced", action=_ShowAdvanced,
                            help="show the advanced options too (experiment switches, diagnostics) and exit")

    def add_argument(self, *args, **kwargs) -> argparse.Action:
        text = kwargs.pop("help", None)
        action = self._group.add_argument(*args, help=argparse.SUPPRESS, **kwargs)
        action._advanced_help = text
        return action


def advanced(parser: argparse.ArgumentParser, description: str = "experiment switches and diagnostics; "
             "the defaults are what the benchmarks measured best") -> AdvancedGroup:
    return AdvancedGroup(parser, description)
