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


def add_data_arguments(parser: argparse.ArgumentParser, *, training: bool) -> None:
    """Where the rows come from: the user's files, or a built-in GLUE shortcut (--task NAME --data-dir DIR)."""
    g = parser.add_argument_group(
        "data", "your own labelled rows: CSV, TSV, JSON Lines, Parquet or a datasets.save_to_disk folder "
        "(columns by name; labels from the data) — or a GLUE shortcut, --task NAME --data-dir DIR")
    g.add_argument("--train", metavar="FILE", help="training rows" + (" (labels and their order come from here)"
                                                                       if training else " (calibration rows)"))
    g.add_argument("--dev", metavar="FILE", help="evaluation rows" + (" (default: hold out 10%% of --train, fixed "
                                                                       "seed)" if training else ""))
    g.add_argument("--text-column", metavar="NAME", help="text column (default: text, sentence, sentence1 or "
                                                         "question); a header-less file names columns 0, 1, ...")
    g.add_argument("--text-pair-column", metavar="NAME", help="second text of a pair task (default: text_pair, or "
                                                              "sentence2 beside sentence1)")
    g.add_argument("--label-column", metavar="NAME", help="label column (default: label, labels or score); "
                                                          "integers or strings are classes, decimals a score")
    g.add_argument("--no-header", action="store_true", help="CSV/TSV without a header line")
    if training:
        g.add_argument("--metric", help="primary metric: accuracy, f1 or mcc (two classes), macro_f1, pearson, "
                                        "spearman (default: accuracy; pearson for scores)")
