"""The user's own labelled texts: CSV, JSON Lines and a GLUE-format TSV that is not a built-in task each
compress, export, evaluate and serve with their own label names, with no code change; bad data gets
one clear error naming the file, the row and the fix."""
import json

import pytest

pytest.importorskip("datasets")

from holoserve import HoloServeError
from holoserve.cli import main
from holoserve.data.sources import DataOptions, load_for_training
from holoserve.data.tabular import Columns
from tests.helpers.tiny import WORDS, make_tiny_bert

FAST = ["--max-steps", "4", "--no-progress", "--threads", "1", "--set", "batch_size=8", "--set", "calib_batches=2"]


def _rows(n: int, classes, seed: int = 0):
    import numpy as np

    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        label = classes[i % len(classes)]
        words = rng.choice(WORDS, 6)
        out.append((f"{label} " + " ".join(words), label))
    return out


def _write_csv(path, rows, header=("review", "stars")):
    import csv

    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(header)
        w.writerows(rows)
    return path


def _write_jsonl(path, rows, text="text", label="label"):
    path.write_text("".join(json.dumps({text: t, label: lab}) + "\n" for t, lab in rows))
    return path


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_tiny_bert(tmp_path_factory.mktemp("base") / "tiny", hidden=32, intermediate=64)


def _serve_predict(ckpt, body):
    import time

    from starlette.testclient import TestClient

    from holoserve.server.app import create_app
    from holoserve.server.config import ServerConfig

    with TestClient(create_app(ServerConfig(artifact_dir=str(ckpt), threads=1))) as c:
        for _ in range(300):  # the model loads in the background; /readyz says when
            if c.get("/readyz").status_code == 200:
                break
            time.sleep(0.05)
        r = c.post("/predict", json=body)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.mark.parametrize("kind", ["csv_multiclass_strings", "jsonl_int_labels", "tsv_glue_format_pairs"])
def test_own_data_compresses_exports_evaluates_and_serves(kind, base, tmp_path, capsys):
    if kind == "csv_multiclass_strings":
        classes = ["billing", "outage", "praise"]
        train = _write_csv(tmp_path / "tickets.csv", _rows(60, classes))
        dev = _write_csv(tmp_path / "tickets-dev.csv", _rows(15, classes, seed=1))
        data = ["--train", str(train), "--dev", str(dev), "--text-column", "review", "--label-column", "stars"]
        names, metric = classes, "accuracy"
    elif kind == "jsonl_int_labels":
        train = _write_jsonl(tmp_path / "intents.jsonl", _rows(60, [3, 7]))
        data = ["--train", str(train), "--metric", "f1"]  # no dev file: 10 % held out
        names, metric = ["3", "7"], "f1"
    else:  # a GLUE-format pair task (tab-separated, quotes literal) that is not built in
        lines = ["index\tsentence1\tsentence2\tlabel"] + [
            f"{i}\t\"{t}\t{t[::-1]}\t{'same' if i % 2 else 'different'}" for i, (t, _) in enumerate(_rows(60, [0]))]
        train = tmp_path / "paraphrase.tsv"
        train.write_text("\n".join(lines) + "\n")
        data = ["--train", str(train), "--task", "paraphrase"]
        names, metric = ["different", "same"], "accuracy"
    out = tmp_path / "ckpt"
    assert main(["compress", "--model", str(base), "--out", str(out), *data, *FAST]) == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    assert m["task"]["labels"] == names and m["metrics"]["primary"] == metric
    assert m["task"]["pair"] == (kind == "tsv_glue_format_pairs")
    assert m["training"]["data"]["train"] == train.name
    if kind == "jsonl_int_labels":
        assert m["training"]["data"]["dev"].startswith("held out: 6 of the training rows")
    export_data = [a for a in data if a not in ("--metric", "f1", "--task", "paraphrase")]
    assert main(["export", str(out), "--target", "onnxruntime", *export_data, "--no-polygraphy"]) == 0
    dev_file = data[data.index("--dev") + 1] if "--dev" in data else str(train)
    cols = data[data.index("--text-column"):data.index("--text-column") + 4] if "--text-column" in data else []
    capsys.readouterr()
    assert main(["eval", str(out), "--dev", dev_file, *cols, "--onnx"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["primary"] == metric and 0.0 <= got["metrics"][metric] <= 1.0 and got["rows"] > 0
    body = {"pairs": [["a film", "mlif a"], ["one", "eno"]]} if kind == "tsv_glue_format_pairs" else \
        {"texts": ["billing late again", "all good"]}
    answer = _serve_predict(out, body)
    assert len(answer["predictions"]) == 2 and {p["label"] for p in answer["predictions"]} <= set(names)


def _opts(tmp_path, **kw):
    return DataOptions(train=kw.pop("train"), dev=kw.pop("dev", None), columns=Columns(**kw))


@pytest.mark.parametrize("setup,match", [
    (lambda p: _write_csv(p / "a.csv", [("x", "1")], header=("words", "label")),
     r"no text column among 'words', 'label'; pass --text-column"),
    (lambda p: (p / "a.csv").write_text("") and None or p / "a.csv", r"a.csv is empty"),
    (lambda p: _write_csv(p / "a.csv", [("good", "pos"), ("bad", "pos")], header=("text", "label")),
     r"every training row has the label 'pos'"),
    (lambda p: _write_csv(p / "a.csv", [("good", "pos"), ("bad", "3")], header=("text", "label")),
     r"mixes label types: row 1 is text, row 2 is a number"),
    (lambda p: _write_csv(p / "a.csv", [("good", "pos"), ("  ", "neg")], header=("text", "label")),
     r"row 2 has an empty text in column 'text'"),
    (lambda p: (p / "a.csv").write_bytes(b"text,label\n\xff\xfe bad,1\nok,0\n") and None or p / "a.csv", r"not UTF-8"),
])
def test_bad_data_is_one_clear_error(setup, match, tmp_path):
    path = setup(tmp_path)
    with pytest.raises(HoloServeError, match=match):
        load_for_training(None, _opts(tmp_path, train=path))


def test_dev_labels_must_be_known_and_pairs_complete(tmp_path):
    train = _write_csv(tmp_path / "t.csv", [("a b", "pos"), ("c d", "neg")] * 6, header=("text", "label"))
    dev = _write_csv(tmp_path / "d.csv", [("a b", "pos"), ("e f", "meh")], header=("text", "label"))
    with pytest.raises(HoloServeError, match=r"d.csv: row 2 has the label 'meh', which no training row has"):
        load_for_training(None, _opts(tmp_path, train=train, dev=dev))
    pairs = _write_csv(tmp_path / "p.csv", [("a", "b", "1"), ("c", "", "0")], header=("text", "text_pair", "label"))
    with pytest.raises(HoloServeError, match=r"row 2 has an empty text pair in column 'text_pair'"):
        load_for_training(None, _opts(tmp_path, train=pairs))


def test_float_labels_are_a_regression_and_parquet_and_saved_folders_read(tmp_path):
    import datasets

    rows = [{"text": f"t {i}", "score": i / 4} for i in range(20)]
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "s.parquet"))
    d = load_for_training(None, _opts(tmp_path, train=tmp_path / "s.parquet"))
    assert d.task.is_regression and d.task.primary_metric == "pearson" and len(d.train) + len(d.dev) == 20
    datasets.Dataset.from_list([{"sentence": f"s {i}", "label": ["a", "b"][i % 2]} for i in range(12)]) \
        .save_to_disk(str(tmp_path / "saved"))
    d = load_for_training("mine", _opts(tmp_path, train=tmp_path / "saved"))
    assert d.task.labels == ("a", "b") and d.task.name == "mine" and d.info["dev"].startswith("held out")
    with pytest.raises(HoloServeError, match="--metric 'mcc' does not fit regression"):
        load_for_training(None, _opts(tmp_path, train=tmp_path / "s.parquet"), metric="mcc")
