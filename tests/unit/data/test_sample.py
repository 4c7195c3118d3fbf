"""The embedded dataset (holoserve.data.sample): the shipped files, how they are drawn, and when they are used."""
import hashlib
import os
import re
from pathlib import Path

import pytest

from holoserve import HoloServeError
from holoserve.data import sample
from holoserve.data.glue import read_split
from holoserve.data.sources import DataOptions, load_for_training, rows_for
from holoserve.data.tasks import get_task


def test_the_shipped_files_are_the_ones_the_readme_and_the_code_name():
    readme = (sample.root() / "README.md").read_text()
    for split in sample.SPLITS:
        digest = hashlib.sha256(sample.file(split).read_bytes()).hexdigest()
        assert digest == sample.SHA256[split]
        assert re.search(rf"`SST-2/{split}\.tsv` \| [^|]+ \| [0-9,]+ \| `{digest}`", readme), split
    train, dev = (read_split("sst2", s, sample.root()) for s in ("train", "dev"))
    assert len(train) == sample.TRAIN_ROWS and len(dev) == 872
    assert {r.label for r in train} == {0, 1} and {r.label for r in dev} == {0, 1}
    assert "Licence" in readme and "Socher" in readme


def _glue(root: Path, train_rows: int = 2500) -> Path:
    (root / "SST-2").mkdir(parents=True)
    lines = [f"row number {i} is {'good' if i % 3 else 'bad'} \t{int(bool(i % 3))}\n" for i in range(train_rows)]
    (root / "SST-2" / "train.tsv").write_text("sentence\tlabel\n" + "".join(lines))
    (root / "SST-2" / "dev.tsv").write_text("sentence\tlabel\na dev row \t1\n")
    return root


def test_build_keeps_a_seeded_sample_of_train_lines_in_order_and_the_whole_dev_file(tmp_path):
    glue = _glue(tmp_path / "glue")
    digests = sample.build(glue, tmp_path / "out")
    train = (tmp_path / "out" / "SST-2" / "train.tsv").read_text().splitlines(keepends=True)
    source = (glue / "SST-2" / "train.tsv").read_text().splitlines(keepends=True)
    assert train[0] == source[0] and len(train) == sample.TRAIN_ROWS + 1
    positions = [source.index(line) for line in train[1:]]
    assert positions == sorted(positions) and len(set(positions)) == sample.TRAIN_ROWS
    assert (tmp_path / "out" / "SST-2" / "dev.tsv").read_bytes() == (glue / "SST-2" / "dev.tsv").read_bytes()
    assert sample.build(glue, tmp_path / "again") == digests  # deterministic
    assert digests["train"] == hashlib.sha256("".join(train).encode()).hexdigest()


def test_build_refuses_what_is_not_glue_sst2(tmp_path, capsys):
    with pytest.raises(HoloServeError, match="missing .*SST-2/train.tsv"):
        sample.build(tmp_path / "nothing", tmp_path / "out")
    glue = _glue(tmp_path / "small", train_rows=10)
    with pytest.raises(HoloServeError, match="is not GLUE's SST-2 train file"):
        sample.build(glue, tmp_path / "out")
    assert sample.main(["--glue-dir", str(tmp_path / "nothing"), "--out", str(tmp_path / "o")]) == 2
    assert "error: missing" in capsys.readouterr().err


@pytest.mark.integration
def test_regenerating_from_glue_reproduces_the_shipped_files(tmp_path, capsys):
    glue = os.environ.get("HOLOSERVE_DATA_DIR")
    if not glue or not (Path(glue) / "SST-2" / "train.tsv").is_file():
        pytest.skip("HOLOSERVE_DATA_DIR is not set to a GLUE folder with SST-2 (CI sets it)")
    assert sample.main(["--glue-dir", glue, "--out", str(tmp_path)]) == 0, capsys.readouterr().out
    for split in sample.SPLITS:
        assert (tmp_path / "SST-2" / f"{split}.tsv").read_bytes() == sample.file(split).read_bytes()


def test_no_data_options_means_the_embedded_sample(tmp_path, monkeypatch):
    monkeypatch.setenv("HOLOSERVE_DATA_DIR", str(tmp_path / "not-used"))  # the default ignores it
    d = load_for_training(None, DataOptions(), train_limit=50, dev_limit=20)
    assert d.task.name == "sst2" and len(d.train) == 50 and len(d.dev) == 20
    assert d.info["source"] == "embedded" and d.info["sha256"] == sample.SHA256
    # a GLUE shortcut, or a GLUE folder, still means GLUE's files
    with pytest.raises(HoloServeError, match="does not exist"):
        load_for_training("sst2", DataOptions())
    with pytest.raises(HoloServeError, match="does not exist"):
        load_for_training(None, DataOptions(data_dir=tmp_path / "missing"))


def test_a_checkpoint_trained_on_the_sample_reads_its_rows_by_default(monkeypatch):
    monkeypatch.delenv("HOLOSERVE_DATA_DIR", raising=False)
    task = get_task("sst2")
    assert rows_for(task, "dev", DataOptions()) is None  # no data: built-in sentences, as before
    rows = rows_for(task, "dev", DataOptions(), limit=5, embedded=True)
    assert [r.text for r in rows] == [r.text for r in read_split(task, "dev", sample.root(), limit=5)]
    assert rows_for(get_task("mrpc"), "dev", DataOptions(), embedded=True) is None
