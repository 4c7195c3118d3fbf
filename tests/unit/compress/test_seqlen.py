"""max_seq_length from the data (compress.seqlen): the rule, its caps, the user's override, and what the
checkpoint records."""
import json
import os
from pathlib import Path

import numpy as np
import pytest

from holoserve import HoloServeError
from holoserve.cli import main
from holoserve.compress.seqlen import COVERAGE, MULTIPLE, choose, model_positions

from tests.helpers.checkpoints import write_glue
from tests.helpers.tiny import make_tiny_bert

FAST = ["--max-steps", "3", "--threads", "1", "--no-progress", "--set", "calib_batches=2"]


def test_the_length_holds_99_percent_of_the_rows_rounded_up_and_capped():
    lengths = np.array([10] * 98 + [40, 300])  # 99 % of the rows fit in 40 tokens
    got = choose(lengths, cap=128, positions=512)
    assert (got.value, got.source, got.tokens_at_coverage) == (64, "data", 40)  # 40 rounded up to 64
    assert got.train_rows == 100 and got.train_rows_truncated == 1 and got.longest_row == 300
    assert choose(lengths, cap=48, positions=512).value == 48  # the preset caps it
    assert choose(lengths, cap=128, positions=50).value == 50  # so does the model's position table
    assert choose(np.array([3, 4, 5]), cap=128, positions=None).value == MULTIPLE  # never below one multiple
    # RTE-like pairs: a long tail is kept up to the cap
    rte = np.concatenate([np.full(88, 56), np.full(11, 150), [197]])
    assert choose(rte, cap=128, positions=512).value == 128 and choose(rte, cap=512, positions=512).value == 160
    rec = got.record()
    assert rec["coverage"] == COVERAGE and rec["multiple"] == MULTIPLE and "value" not in rec
    assert "99% of the 100 tokenized training rows fit in 40 tokens" in got.describe()


def test_the_users_length_wins_within_the_models_positions():
    got = choose(np.array([10, 20, 200]), cap=64, positions=512, fixed=256)
    assert (got.value, got.source, got.train_rows_truncated) == (256, "option", 0)
    with pytest.raises(HoloServeError, match="more than the model's position table holds \\(512"):
        choose(np.array([10]), cap=64, positions=512, fixed=600)
    with pytest.raises(HoloServeError, match="at least 2 tokens"):
        choose(np.array([10]), cap=64, positions=512, fixed=1)


def test_model_positions_reads_config_json(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert", "max_position_embeddings": 512}))
    assert model_positions(tmp_path) == 512
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "roberta", "max_position_embeddings": 514,
                                                      "pad_token_id": 1}))
    assert model_positions(tmp_path) == 512  # positions start after the padding index
    (tmp_path / "config.json").write_text("{not json")
    assert model_positions(tmp_path) is None
    assert model_positions(tmp_path / "missing") is None


@pytest.fixture(scope="module")
def env(tmp_path_factory):
    root = tmp_path_factory.mktemp("seqlen")
    return {"root": root, "model": make_tiny_bert(root / "tiny", hidden=32, intermediate=64),
            "glue": write_glue(root / "glue")}


def test_compress_records_how_the_length_was_chosen(env, caplog):
    out = env["root"] / "data"
    caplog.set_level("INFO", logger="holoserve.compress")
    assert main(["compress", "--task", "sst2", "--data-dir", str(env["glue"]), "--model", str(env["model"]),
                 "--out", str(out), *FAST]) == 0
    m = json.loads((out / "manifest.json").read_text())
    seq = m["sequence_length"]
    assert m["schema_version"] == 3 and seq["source"] == "data" and seq["preset_cap"] == 64
    assert seq["model_positions"] == 128 and seq["train_rows"] == m["training"]["train_rows"]
    assert m["max_seq_length"] == max(MULTIPLE, -(-seq["tokens_at_coverage"] // MULTIPLE) * MULTIPLE)
    assert m["training"]["preset_config"]["max_seq_length"] == m["max_seq_length"]
    text = caplog.text
    assert f"max_seq_length {m['max_seq_length']} from the data" in text
    assert "--method oneshot, preset quick: dense 3, qat 6 (batch 32)" in text  # the steps that run

    out = env["root"] / "option"
    assert main(["compress", "--task", "sst2", "--data-dir", str(env["glue"]), "--model", str(env["model"]),
                 "--out", str(out), "--max-seq-length", "100", "--method", "admm", *FAST]) == 0
    m = json.loads((out / "manifest.json").read_text())
    assert m["max_seq_length"] == 100 and m["sequence_length"]["source"] == "option"
    assert "--method admm, preset quick: dense 3, admm 3, qat 3" in caplog.text


def test_a_length_the_model_cannot_take_is_refused_before_training(env, capsys):
    out = env["root"] / "too-long"
    assert main(["compress", "--task", "sst2", "--data-dir", str(env["glue"]), "--model", str(env["model"]),
                 "--out", str(out), "--max-seq-length", "129", *FAST]) == 2
    assert "--max-seq-length 129 is more than the model's position table holds (128" in capsys.readouterr().err
    assert main(["compress", "--out", str(out), "--max-seq-length", "0"]) == 2
    assert "--max-seq-length must be a positive number" in capsys.readouterr().err


@pytest.mark.integration
def test_glue_sst2_keeps_the_quick_presets_64_tokens():
    """The rule gives the GLUE SST-2 shortcut the quick preset's former fixed length, 64 (so its quick checkpoint
    is trained, exported and served as before), and 64 under the full preset too, where it used to be 128."""
    glue = os.environ.get("HOLOSERVE_DATA_DIR")
    if not glue or not (Path(glue) / "SST-2" / "train.tsv").is_file():
        pytest.skip("HOLOSERVE_DATA_DIR is not set to a GLUE folder with SST-2 (CI sets it)")
    from holoserve.compress.context import default_model_dir
    from holoserve.compress.seqlen import UNBOUNDED, token_lengths
    from holoserve.core.tokenizer import load_tokenizer
    from holoserve.data.glue import read_split

    model = default_model_dir()
    lengths = token_lengths(load_tokenizer(model, UNBOUNDED), read_split("sst2", "train", glue))
    assert choose(lengths, cap=64, positions=model_positions(model)).value == 64
    assert choose(lengths, cap=128, positions=model_positions(model)).value == 64
