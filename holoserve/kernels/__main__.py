"""python -m holoserve.kernels [build|check]: build the 2:4 kernels' OpenVINO extension ahead of time (into
$HOLOSERVE_KERNEL_CACHE, default ~/.cache/holoserve/kernels), or say whether this machine can run them."""
from __future__ import annotations

import sys

from holoserve import HoloServeError

from . import build, cpu_missing, library_path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "check"
    if command not in ("build", "check") or len(args) > 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    try:
        if command == "build":
            print(build(verbose=True))
            return 0
        missing = cpu_missing()
        if missing:
            print(f"no: this CPU lacks {', '.join(missing)}")
            return 1
        path = library_path()
        print(f"yes: {'built' if path.is_file() else 'not built yet'} at {path}")
        return 0
    except HoloServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
