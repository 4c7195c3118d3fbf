"""`holoserve bench`: timing loop, unavailable backends, result files, light imports."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from holoserve.backends import base
from holoserve.cli import main


class _FakeBackend:
    """Deterministic stand-in that records what it was fed."""

    name = "fake"

    def __init__(self, art):
        self.art = art
        self.seen: list[np.ndarray] = []

    def infer(self, input_ids, attention_mask, token_type_ids):
        self.seen.append(input_ids.copy())
        return np.zeros((input_ids.shape[0], 2), dtype=np.float32)

    def info(self):
        return {"backend": "fake"}


LOADED: list[_FakeBackend] = []


def fake_load(artifact, **_):
    b = _FakeBackend(artifact)
    LOADED.append(b)
    return b


@pytest.fixture()
def fake_backend():
    base.register("fake", "tests.unit.cli.test_bench_cli:fake_load")
    LOADED.clear()
    try:
        yield
    finally:
        base._LOADERS.pop("fake", None)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.sparsify import project_layers
    from holoserve.data.tasks import get_task
    from tests.helpers.tiny import make_tiny_bert

    root = tmp_path_factory.mktemp("bench")
    src = make_tiny_bert(root / "base")
    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    scales = project_layers(model)
    art = save_checkpoint(model, src, root / "ckpt", CheckpointContents(task=get_task("sst2"), base_model="tiny",
        max_seq_length=64, sparse_layers=list(scales), weight_scales=scales))
    return art.path


def test_bench_times_backends_and_writes_results(checkpoint, fake_backend, tmp_path, capsys):
    out = tmp_path / "res"
    rc = main(["bench", str(checkpoint), "--backend", "fake,torch-cuda", "--batch", "1,3", "--seq", "16,32",
               "--warmup", "1", "--iters", "4", "--out", str(out), "--name", "t"])
    assert rc == 0
    report = json.loads((out / "t.json").read_text())
    rows = [r for r in report["results"] if r["backend"] == "fake"]
    assert sorted((r["batch"], r["seq"]) for r in rows) == [(1, 16), (1, 32), (3, 16), (3, 32)]
    assert all(r["latency_ms_median"] >= 0 and r["iters"] == 4 for r in rows)
    # torch-cuda cannot run here: reported with its reason, not a crash
    tcuda = report["backends"]["torch-cuda"]
    assert tcuda["status"] in ("unavailable", "ok")
    if tcuda["status"] != "ok":
        assert tcuda["reason"]
        assert "torch-cuda" in (out / "t.md").read_text()
    assert (out / "t.png").stat().st_size > 1000
    assert report["machine"]["cpu"].endswith("CPU")
    # fresh inputs: 5 calls per configuration, all different, no all-zero rows, no padding id
    seen = LOADED[0].seen
    assert len(seen) == 4 * (1 + 4)
    assert len({a.tobytes() for a in seen}) == len(seen)
    assert all((a != 0).all() for a in seen)
    assert "median ms" in capsys.readouterr().out


def test_bench_unknown_backend_is_a_clear_error(checkpoint, capsys):
    rc = main(["bench", str(checkpoint), "--backend", "nope", "--no-save"])
    assert rc == 2
    assert "unknown backend" in capsys.readouterr().err


def test_bench_rejects_sequence_longer_than_checkpoint(checkpoint, capsys):
    rc = main(["bench", str(checkpoint), "--backend", "onnxruntime", "--seq", "512", "--no-save"])
    assert rc == 2
    assert "max_seq_length" in capsys.readouterr().err


def test_bench_bad_batch_list_is_rejected(checkpoint):
    with pytest.raises(SystemExit):
        main(["bench", str(checkpoint), "--batch", "0,x"])


def test_bench_cli_module_is_light():
    code = ("import sys, holoserve.bench_cli; bad = [m for m in ('torch', 'numpy', 'transformers') "
            "if m in sys.modules]; print(bad); sys.exit(1 if bad else 0)")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_markdown_table_formats_missing_values():
    from holoserve.bench_cli import markdown_table

    md = markdown_table([{"a": 1.23456, "b": None}], [("a", "A"), ("b", "B")])
    assert md.splitlines()[2] == "| 1.235 | — |"
