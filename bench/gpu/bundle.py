#!/usr/bin/env python3
"""Bundle what the GPU benchmark needs next to a checkout, in git-ignored folders small enough to copy with it.

    python -m bench.gpu.bundle CHECKPOINT [--data-dir GLUE_DIR] [--serve] [--cslt] [--wheel-script PATH]

writes
    .carry/checkpoint/   the checkpoint packed (int8 codes + fp16 embeddings; see pack.py)
    .carry/glue/<TASK>/dev.tsv   the task's dev split, for the parity check
    .carry/carry.json    what is inside and how big
    .whl/                wheels a GPU image with torch and transformers may lack (torchao 0.16.0: the last
                         release with int8_dynamic_activation_int8_semi_sparse_weight; pure Python, no deps;
                         `datasets` and the few of its needs such an image lacks, to read GLUE;
                         with --serve also the HTTP stack for bench/serve_load)
    .whl-cslt/           with --cslt: nvmath-python and the cuda-python packages it imports,
                         for the kernel "cslt_fused" (cuSPARSELt called directly)

and checks that the packed checkpoint unpacks to the same INT8 weights. It prints the sizes of the
checkout and these folders, and exits with status 1 when together they exceed --max-mib.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.gpu import pack

ROOT = Path(__file__).resolve().parents[2]

DEFAULT_WHEELS = ["torchao==0.16.0"]
# holoserve.data reads CSV/TSV through `datasets`, which the parity check and `holoserve compress` need; its heavier
# needs (pyarrow, pandas, xxhash, huggingface-hub) are expected on the GPU machine already.
DATA_PACKAGES = ["datasets", "dill", "multiprocess", "fsspec"]
# `holoserve serve` and bench/serve_load where torch, transformers and tokenizers are installed but not the
# HTTP stack: pinned to the versions installed here, which the tests run.
SERVE_PACKAGES = ["fastapi", "starlette", "pydantic", "pydantic-core", "typing-inspection", "annotated-types",
                  "uvicorn", "httptools", "uvloop", "h11", "click", "anyio", "idna", "prometheus-client",
                  "opentelemetry-api", "annotated-doc"]


def pinned(names: list[str], why: str) -> list[str]:
    """NAME==VERSION for each package, at the version installed here (the one the tests run)."""
    from importlib.metadata import PackageNotFoundError, version

    specs = []
    for name in names:
        try:
            specs.append(f"{name}=={version(name)}")
        except PackageNotFoundError:
            raise SystemExit(f"{why}: {name} is not installed here; pip install -e '.[compress]' first") from None
    return specs


def serve_wheels() -> list[str]:
    return pinned(SERVE_PACKAGES, "--serve")


def data_wheels() -> list[str]:
    return pinned(DATA_PACKAGES, "GLUE reading on the GPU machine")


# kernel "cslt_fused" (cuSPARSELt's own API through nvmath-python): the bindings and what importing them needs;
# the library itself is the libcusparseLt torch's CUDA build installs
CSLT_PACKAGES = ["nvmath-python", "cuda-bindings", "cuda-core", "cuda-pathfinder"]


def cslt_wheels() -> list[str]:
    return pinned(CSLT_PACKAGES, "--cslt")


SIZE_LIMIT_MIB = 64.0  # default of --max-mib: the checkout plus the bundled folders, as one copy


def fetch_wheels(specs: list[str], dest: Path, script: str | None) -> list[str]:
    """Download py3.12 manylinux wheels (no deps) into dest, one version per package."""
    dest.mkdir(parents=True, exist_ok=True)
    for spec in specs:  # keep a single version of each package: two stop the install there
        name = spec.split("==")[0].replace("-", "_").lower()
        for old in dest.glob("*.whl"):
            if old.name.lower().startswith(name + "-"):
                old.unlink()
    if script:
        subprocess.run(["bash", script, *specs], check=True, cwd=ROOT)
    else:
        plats = []
        for n in (17, 24, 27, 28, 31, 34, 35):
            plats += ["--platform", f"manylinux_2_{n}_x86_64"]
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                        "--python-version", "3.12", "--implementation", "cp", *plats,
                        "--platform", "manylinux2014_x86_64", "--platform", "any", "-d", str(dest), *specs],
                       check=True)
    return sorted(p.name for p in dest.glob("*.whl"))


def tree_bytes() -> int:
    """Bytes of the checkout as copied: tracked files and the untracked ones git does not ignore."""
    try:
        out = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    total = 0
    for rel in out.decode().split("\0"):
        p = ROOT / rel
        if rel and p.is_file():
            total += p.stat().st_size
    return total


def report_sizes(sizes: dict[str, int], limit_mib: float = SIZE_LIMIT_MIB) -> int:
    """Print the sizes of what is copied; exit status 1 when together they exceed limit_mib."""
    total = sum(sizes.values()) / 2**20
    print(json.dumps({k: f"{v / 2**20:.1f} MiB" for k, v in sizes.items()}))
    if total > limit_mib:
        print(f"WARNING: {total:.1f} MiB exceeds the {limit_mib:.0f} MiB limit (--max-mib)")
        return 1
    print(f"total {total:.1f} MiB of {limit_mib:.0f} MiB: ready")
    return 0


def folder_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.exists() else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu.bundle", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", help="compressed checkpoint folder (e.g. runs/minilm-sst2-quick)")
    ap.add_argument("--carry", default=str(ROOT / ".carry"), help="output folder (default .carry, git-ignored)")
    ap.add_argument("--wheels", default=str(ROOT / ".whl"), help="wheel folder (default .whl, git-ignored)")
    ap.add_argument("--wheel", action="append", default=None, help="NAME==VERSION to fetch (default torchao==0.16.0)")
    ap.add_argument("--wheel-script", default=os.environ.get("HOLOSERVE_GPU_WHEELS"),
                    help="script that downloads GPU wheels into .whl/ (default: pip download with the same flags)")
    ap.add_argument("--no-wheels", action="store_true", help="skip downloading wheels")
    ap.add_argument("--serve", action="store_true",
                    help="also fetch the HTTP stack (FastAPI, uvicorn, ...) for bench/serve_load with "
                         "--backend torch-cuda on the GPU")
    ap.add_argument("--cslt", action="store_true",
                    help="also fetch nvmath-python and its cuda-python packages into .whl-cslt/, for "
                         "kernel 'cslt_fused' and tests/gpu/test_cslt_epilogue.py "
                         "(pip install 'holoserve[gpu]' here first)")
    ap.add_argument("--cslt-wheels", default=str(ROOT / ".whl-cslt"),
                    help="its folder (default .whl-cslt, git-ignored)")
    ap.add_argument("--exact-embeddings", action="store_true",
                    help="keep the embedding tables in FP32 too, for a bit-identical checkpoint (a larger bundle)")
    ap.add_argument("--max-mib", type=float, default=SIZE_LIMIT_MIB,
                    help="exit with status 1 when the checkout plus these folders exceed this "
                         f"(default {SIZE_LIMIT_MIB:.0f})")
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"),
                    help="GLUE folder (default $HOLOSERVE_DATA_DIR); its dev split is bundled for the parity check")
    args = ap.parse_args(argv)

    from holoserve.core.artifact import load_artifact

    from holoserve.core.files import atomic_write_json
    from holoserve.data.tasks import get_task

    art = load_artifact(args.checkpoint)
    out = Path(args.carry)
    out.mkdir(parents=True, exist_ok=True)
    info = pack.pack(art.path, out / "checkpoint", fp16_min_elements=2**62 if args.exact_embeddings else None)
    print(f"packed {art.path} -> {out / 'checkpoint'} ({info['bytes'] / 2**20:.1f} MiB of weights)")

    # prove the round trip: same INT8 weights, same sparsity, a loadable checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        back = pack.unpack(out / "checkpoint", Path(tmp) / "ckpt")
        from safetensors.numpy import load_file

        a = load_file(str(art.path / "model.safetensors"))
        b = load_file(str(back.path / "model.safetensors"))
        for key, kind in info["kinds"].items():
            if kind == "int8" and not (a[key] == b[key]).all():
                raise SystemExit(f"round trip changed INT8 layer {key}")
        print(f"round trip ok: {sum(k == 'int8' for k in info['kinds'].values())} INT8 layers bit-identical; "
              f"fp16 max abs error {max(info['fp16_max_abs_error'].values(), default=0):.2e}")

    task = get_task(art.task_name)
    dev_copied = None
    if args.data_dir:
        src = Path(args.data_dir) / task.folder / "dev.tsv"
        if src.is_file():
            dst = out / "glue" / task.folder / "dev.tsv"
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            dev_copied = str(dst.relative_to(out))
            print(f"copied {task.folder} dev split ({src.stat().st_size / 1024:.0f} KiB)")
    if not dev_copied:
        print("no GLUE dev split copied (give --data-dir or set HOLOSERVE_DATA_DIR): the GPU run will skip parity")

    wheels: list[str] = []
    if not args.no_wheels:
        wheels = fetch_wheels((args.wheel or DEFAULT_WHEELS) + data_wheels() + (serve_wheels() if args.serve else []),
                              Path(args.wheels), args.wheel_script)
        print(f"wheels: {', '.join(wheels)}")

    if args.cslt and not args.no_wheels:
        wheels += fetch_wheels(cslt_wheels(), Path(args.cslt_wheels), args.wheel_script)
    sizes = {"carry": folder_bytes(out), "wheels": folder_bytes(Path(args.wheels)), "tree": tree_bytes()}
    if args.cslt:
        sizes["cslt_wheels"] = folder_bytes(Path(args.cslt_wheels))
    atomic_write_json(out / "carry.json", {"checkpoint": art.path.name, "task": task.name, "dev": dev_copied,
                                           "wheels": wheels, "bytes": sizes, "pack": {k: v for k, v in info.items()
                                                                                     if k != "kinds"}})
    return report_sizes(sizes, args.max_mib)


if __name__ == "__main__":
    sys.exit(main())
