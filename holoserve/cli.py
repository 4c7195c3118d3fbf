"""The one CLI: `holoserve compress | eval | export | build-engine | tune | serve | bench`.

Each stage defines its own arguments in a light module (`<pkg>/cli.py`, no heavy imports at
module level) so that `holoserve serve` works without torch installed.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from . import HoloServeError, __version__

# subcommand -> (module, help). The module provides add_arguments(parser) and run(args) -> int.
COMMANDS = {
    "compress": ("holoserve.compress.cli", "fine-tune a BERT-family model into a 2:4 sparse INT8 checkpoint"),
    "eval": ("holoserve.compress.evaluate_cli", "score a checkpoint on labelled dev rows (its own, --dev FILE or a "
                                                "GLUE split) with the export's numerics"),
    "export": ("holoserve.export.cli", "export a checkpoint to ONNX with QDQ nodes"),
    "build-engine": ("holoserve.export.engine_cli", "build a TensorRT engine (INT8 + sparse weights) "
                                                    "from ONNX or a checkpoint"),
    "tune": ("holoserve.tune_cli", "time this machine's CPU backends on the checkpoint's dev texts and write the "
                                   "serving profile that `serve --backend auto` follows without timing at start-up"),
    "serve": ("holoserve.serve_cli", "serve a checkpoint over HTTP (POST /predict)"),
    "bench": ("holoserve.bench_cli", "benchmark a checkpoint's backends on this machine"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="holoserve", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"holoserve {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        try:
            mod = importlib.import_module(module)
        except ImportError as e:
            # The stage is not installed (e.g. the slim server image has no compress/export extras).
            p.set_defaults(_missing=f"`holoserve {name}` is unavailable: {e}. Install the matching extra, "
                                    f"e.g. pip install 'holoserve[compress,export]'")
            continue
        mod.add_arguments(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.command:
        parser.print_help()
        return 2
    if getattr(args, "_missing", None):
        print(f"error: {args._missing}", file=sys.stderr)
        return 2
    try:
        return int(args._run(args) or 0)
    except HoloServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
