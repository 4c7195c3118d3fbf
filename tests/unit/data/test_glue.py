"""GLUE readers (quoting off, BOM, header-less CoLA) and metrics."""
import numpy as np
import pytest

from holoserve import HoloServeError
from holoserve.data.glue import read_split, resolve_data_dir
from holoserve.data.metrics import accuracy, compute, f1, mcc, pearson, spearman
from holoserve.data.tasks import get_task


def _write(path, text, encoding="utf-8"):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding=encoding)


def test_sst2_quotes_are_literal(tmp_path):
    _write(tmp_path / "SST-2" / "train.tsv",
           'sentence\tlabel\n"a film that " works\t1\nit \'s "bad\t0\n\n')
    rows = read_split("sst2", "train", tmp_path)
    assert [r.text for r in rows] == ['"a film that " works', 'it \'s "bad']
    assert [r.label for r in rows] == [1, 0] and rows[0].text_pair is None


def test_mrpc_bom_and_pairs(tmp_path):
    _write(tmp_path / "MRPC" / "dev.tsv",
           "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n1\t1\t2\tHe said \"yes\".\tHe agreed.\n0\t3\t4\tA\tB\n",
           encoding="utf-8-sig")
    rows = read_split("mrpc", "dev", tmp_path)
    assert len(rows) == 2 and rows[0].text == 'He said "yes".' and rows[0].text_pair == "He agreed."
    assert rows[0].label == 1 and rows[1].label == 0


def test_cola_has_no_header(tmp_path):
    _write(tmp_path / "CoLA" / "train.tsv", "gj04\t1\t\tOur friends won't buy this.\ngj04\t0\t*\tThey drank the pub.\n")
    rows = read_split(get_task("CoLA"), "train", tmp_path)
    assert [r.label for r in rows] == [1, 0] and rows[0].text == "Our friends won't buy this."


def test_stsb_is_regression_and_limit(tmp_path):
    header = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore\n"
    body = "".join(f"{i}\tg\tf\t2012\t{i}\ts\ts\tA {i}\tB {i}\t{i / 2}\n" for i in range(5))
    _write(tmp_path / "STS-B" / "dev.tsv", header + body)
    rows = read_split("sts-b", "dev", tmp_path, limit=3)
    assert [r.label for r in rows] == [0.0, 0.5, 1.0] and rows[2].text_pair == "B 2"


def test_reader_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("HOLOSERVE_DATA_DIR", raising=False)
    with pytest.raises(HoloServeError, match="--data-dir"):
        resolve_data_dir(None)
    monkeypatch.setenv("HOLOSERVE_DATA_DIR", str(tmp_path))
    assert resolve_data_dir(None) == tmp_path
    with pytest.raises(HoloServeError, match="missing GLUE file"):
        read_split("sst2", "dev", tmp_path)
    _write(tmp_path / "SST-2" / "dev.tsv", "sentence\tlabel\ngood\t7\n")
    with pytest.raises(HoloServeError, match="label '7'"):
        read_split("sst2", "dev", tmp_path)
    with pytest.raises(HoloServeError, match="no 'train' split"):
        read_split("qnli", "train", tmp_path)
    with pytest.raises(HoloServeError, match="unknown task"):
        get_task("imdb")


def test_metrics_against_reference():
    scipy_stats = pytest.importorskip("scipy.stats")
    rng = np.random.default_rng(0)
    gold = rng.integers(0, 2, 200)
    pred = np.where(rng.random(200) < 0.8, gold, 1 - gold)
    tp = np.sum((pred == 1) & (gold == 1))
    assert accuracy(pred, gold) == pytest.approx(np.mean(pred == gold))
    assert f1(pred, gold) == pytest.approx(2 * tp / (np.sum(pred == 1) + np.sum(gold == 1)))
    assert mcc(pred, gold) == pytest.approx(np.corrcoef(pred, gold)[0, 1])  # MCC = phi for binary labels
    x, y = rng.normal(size=100), rng.normal(size=100)
    y_tied = np.round(y, 0)
    assert pearson(x, y) == pytest.approx(scipy_stats.pearsonr(x, y)[0])
    assert spearman(x, y_tied) == pytest.approx(scipy_stats.spearmanr(x, y_tied)[0])
    assert mcc([1, 1], [1, 0]) == 0.0 and f1([0, 0], [0, 0]) == 0.0
    assert compute(("f1", "accuracy"), [1, 0, 1], [1, 1, 1]) == pytest.approx({"f1": 0.8, "accuracy": 2 / 3})
