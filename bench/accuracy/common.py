"""What the scripts that score a checkpoint's exports on its dev rows share: the export they need, the dev rows in
tokenized batches, the position-embedding table they perturb, the command line as a report shows it, and the
writing of a report."""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.lib.report import write_record


def export_file(art, checkpoint: Path, target: str, file: str, flag: str = "") -> Path:
    """The checkpoint's export for `target`, or exit with the `holoserve export` command (plus `flag`)
    that writes it."""
    path = art.export_path(target)
    if path is None or not path.is_file():
        raise SystemExit(f"{checkpoint} has no {file}: run `holoserve export {checkpoint}{flag}` first")
    return path


@dataclass
class DevSet:
    """A checkpoint's task and dev rows, tokenized as `holoserve eval` tokenizes them, in batches grouped by length."""
    task: Any
    rows: list
    batches: list  # (row indices, feed dict)
    labels: np.ndarray
    num_labels: int

    def logits(self, run, names) -> np.ndarray:
        """Every row's logits in row order; `run` maps a feed (only the inputs in `names`) to a batch's logits."""
        out = np.zeros((len(self.rows), self.num_labels), dtype=np.float32)
        for idx, feed in self.batches:
            out[idx] = run({k: v for k, v in feed.items() if k in names})
        return out

    def ort_logits(self, path: Path, threads: int = 0) -> np.ndarray:
        """Every row's logits through ONNX Runtime on the model at `path`."""
        from holoserve.core.ort import session

        sess = session(path, threads=threads, quiet=True)
        return self.logits(lambda f: sess.run(None, f)[0], {i.name for i in sess.get_inputs()})


def dev_set(art, data_dir, batch_size: int | None = 64, first: int | None = None) -> DevSet:
    """The checkpoint task's dev rows (the `first` ones, or all), in batches of `batch_size` (None: one batch)."""
    from holoserve.data.glue import read_split
    from holoserve.data.tasks import get_task
    from holoserve.export.reference import encode_batches, make_tokenizer

    task = get_task(art.task_name)
    rows = read_split(task, "dev", data_dir)
    if first is not None:
        rows = rows[:first]
    batches = list(encode_batches(make_tokenizer(art), [x.text for x in rows],
                                  [x.text_pair for x in rows] if task.is_pair else None,
                                  batch_size=batch_size or len(rows)))
    return DevSet(task, rows, batches, np.asarray([x.label for x in rows]), art.num_labels)


def position_table(model) -> int:
    """Index of the float position-embedding initializer of an exported encoder."""
    hits = [i for i, t in enumerate(model.graph.initializer)
            if "position_embeddings" in t.name and t.data_type == 1 and len(t.dims) == 2]
    if len(hits) != 1:
        raise SystemExit(f"expected one float position-embedding table in the export, found {len(hits)}: this script "
                         "perturbs that table, so it needs an encoder with learned absolute positions")
    return hits[0]


def command(argv: list[str], module: str) -> str:
    """The command line as run, with the GLUE folder written as "$GLUE_DIR" (no machine's path in a report)."""
    out, skip = [f"python -m {module}"], False
    for a in argv:
        if skip:
            out.append('"$GLUE_DIR"')
        elif a.startswith("--data-dir="):
            out.append('--data-dir="$GLUE_DIR"')
        else:
            out.append(a)
        skip = a == "--data-dir"
    return " ".join(out)


def save(folder: Path | None, stem: str, report: dict, markdown, plot) -> None:
    """Print the page; with a folder, write STEM.json, STEM.md and STEM.png there, each atomically."""
    print("\n" + markdown(report))
    if folder:
        write_record(report, folder, stem, markdown)
        plot(report, folder / f"{stem}.png")
