"""The labelled dataset that ships with HoloServe: a fixed sample of GLUE SST-2 (binary sentiment), so that
`holoserve compress --out DIR` runs with no data of one's own.

The files live in holoserve/data/sst2-sample/ in GLUE's layout (SST-2/train.tsv, SST-2/dev.tsv), so the
GLUE reader reads them unchanged; their source, terms and checksums are in its README.md. They are
regenerated from the GLUE files, byte for byte, by

    python -m holoserve.data.sample --glue-dir "$GLUE_DIR" --out holoserve/data/sst2-sample

which keeps TRAIN_ROWS training lines drawn with numpy's default_rng(SEED) (in the file's order) and the
whole dev file. Kept torch-free.
"""
from __future__ import annotations

import argparse
import hashlib
import sys
from pathlib import Path

from .. import HoloServeError

FOLDER = "sst2-sample"  # package data of holoserve.data
TASK = "sst2"  # the GLUE shortcut whose layout, labels and metric the sample uses
TRAIN_ROWS = 2000  # of GLUE SST-2's 67,349 training rows; the dev file is whole (872 rows)
SEED = 0
SPLITS = ("train", "dev")
# sha256 of the shipped files (the regeneration above reproduces them; tests check both)
SHA256 = {
    "train": "2552acb6904b0a602bff0b7ab07a104684b6cdf1664c6c976e9c41e1bf27c9a0",
    "dev": "54a9c12c77e402fc14d6a66a506f24d999f596b0176eb777c972cccc2f9cc4b0",
}
DESCRIPTION = (f"the embedded SST-2 sample: {TRAIN_ROWS} GLUE SST-2 training rows (seed {SEED}) and the full "
               "GLUE SST-2 dev set (872 rows), shipped in holoserve/data/sst2-sample")


def root() -> Path:
    """The folder that holds SST-2/{train,dev}.tsv (a GLUE data dir with one task)."""
    import importlib.resources

    path = Path(str(importlib.resources.files("holoserve.data") / FOLDER))
    for split in SPLITS:
        if not (path / "SST-2" / f"{split}.tsv").is_file():
            raise HoloServeError(f"the embedded dataset is missing {path / 'SST-2' / f'{split}.tsv'}: reinstall "
                                 "holoserve, or pass your own rows (--train FILE) or a GLUE folder (--data-dir DIR)")
    return path


def file(split: str) -> Path:
    return root() / "SST-2" / f"{split}.tsv"


def sha256(path: Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def info() -> dict:
    """What a checkpoint records about the rows it was trained on (manifest training.data)."""
    return {"source": "embedded", "name": "SST-2 sample", "description": DESCRIPTION, "train": "SST-2/train.tsv",
            "dev": "SST-2/dev.tsv", "sha256": {s: sha256(file(s)) for s in SPLITS}}


def build(glue_dir: Path, out: Path) -> dict[str, str]:
    """Write the sample from GLUE's SST-2 files into `out` (atomically, per file); returns their sha256."""
    import numpy as np

    from holoserve.core.files import atomic_write_bytes

    src = Path(glue_dir) / "SST-2"
    written = {}
    for split in SPLITS:
        path = src / f"{split}.tsv"
        if not path.is_file():
            raise HoloServeError(f"missing {path}: --glue-dir is the GLUE folder holding SST-2/{split}.tsv")
        data = path.read_bytes()
        if split == "train":
            header, *rows = data.splitlines(keepends=True)
            if header.rstrip(b"\r\n") != b"sentence\tlabel" or len(rows) < TRAIN_ROWS:
                raise HoloServeError(f"{path} is not GLUE's SST-2 train file (header 'sentence<TAB>label', "
                                     f"67,349 rows); it has {len(rows)} rows")
            keep = np.sort(np.random.default_rng(SEED).choice(len(rows), TRAIN_ROWS, replace=False))
            data = header + b"".join(rows[i] for i in keep)
        dst = Path(out) / "SST-2" / f"{split}.tsv"
        dst.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(dst, data)
        written[split] = hashlib.sha256(data).hexdigest()
    return written


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m holoserve.data.sample", description=__doc__.splitlines()[0])
    p.add_argument("--glue-dir", required=True, type=Path, help="the GLUE folder holding SST-2/{train,dev}.tsv")
    p.add_argument("--out", required=True, type=Path, help="where to write SST-2/{train,dev}.tsv")
    args = p.parse_args(argv)
    try:
        digests = build(args.glue_dir, args.out)
    except HoloServeError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for split, digest in digests.items():
        same = "matches" if digest == SHA256[split] else "DIFFERS from"
        print(f"{args.out / 'SST-2' / f'{split}.tsv'}  sha256 {digest} ({same} the shipped file)")
    return 0 if all(digests[s] == SHA256[s] for s in SPLITS) else 1


if __name__ == "__main__":
    sys.exit(main())
