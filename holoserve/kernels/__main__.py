"""python -m holoserve.kernels [build [reference] | check]: build the 2:4 kernels' OpenVINO extension ahead of
serving (into $HOLOSERVE_KERNEL_CACHE, default ~/.cache/holoserve/kernels; needs a C++ compiler, not a CPU that
runs the kernels), or say whether this machine can run them and which build it would load. `build reference`
builds the portable scalar reference that `--openvino-kernels reference` runs on any x86-64 CPU."""
from __future__ import annotations

import logging
import sys

from holoserve import HoloServeError

from holoserve.core.machine import cpu_flags

from . import AVX512, REFERENCE, build, cpu_missing, library_path


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    command = args[0] if args else "check"
    flavour = args[1] if command == "build" and len(args) == 2 else AVX512
    if command not in ("build", "check") or len(args) > (2 if command == "build" else 1) \
            or flavour not in (AVX512, REFERENCE):
        print(__doc__.strip(), file=sys.stderr)
        return 2
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger("holoserve.kernels")
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    try:
        if command == "build":
            print(build(verbose=True, flavour=flavour))
            return 0
        missing = cpu_missing()
        path = library_path()
        where = "no build, and no compiler to make one" if path is None else \
            f"{'built' if path.is_file() else 'not built yet'} at {path}"
        if missing:
            print(f"no: this CPU lacks {', '.join(missing)} (library: {where}); `--openvino-kernels reference` "
                  "runs their portable build here, for checks (the same numbers, many times slower)")
            return 1
        amx = " (--openvino-kernels auto leaves this CPU, which has AMX, to OpenVINO's GEMMs; on forces them)" \
            if "amx_int8" in cpu_flags() else ""
        print(f"yes: {where}{amx}")
        return 0 if path is not None else 1
    except HoloServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
