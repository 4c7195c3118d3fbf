"""Every supported BERT-family encoder goes through compress -> export (both targets) -> eval -> serve, each
from a tiny random model folder built here; a family whose encoder shares weights across layers (ALBERT)
is refused up front with the list of supported families."""
import json
import time

import pytest

pytest.importorskip("transformers")

from holoserve import HoloServeError
from holoserve.cli import main
from tests.helpers.tiny import WORDS, make_tokenizer_dir

FAST = ["--max-steps", "4", "--no-progress", "--threads", "1", "--set", "batch_size=8", "--set", "calib_batches=2"]
FAMILIES = ["bert", "roberta", "xlm-roberta", "electra", "distilbert", "mpnet"]


def _config(family: str, vocab: int):
    import transformers as T

    common = dict(vocab_size=vocab, pad_token_id=0, num_labels=2)
    # 256 positions: RoBERTa-style position ids start at pad_token_id + 1, past max_seq_length + 2
    enc = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=256)
    roberta_ids = dict(type_vocab_size=1, bos_token_id=2, eos_token_id=3)  # one segment, as RoBERTa/XLM-R
    return {
        "bert": lambda: T.BertConfig(**common, **enc),
        "roberta": lambda: T.RobertaConfig(**common, **enc, **roberta_ids),
        "xlm-roberta": lambda: T.XLMRobertaConfig(**common, **enc, **roberta_ids),
        "electra": lambda: T.ElectraConfig(**common, **enc, embedding_size=16),  # with its embedding projection
        "distilbert": lambda: T.DistilBertConfig(**common, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                                 max_position_embeddings=256),
        "mpnet": lambda: T.MPNetConfig(**common, **enc),
        "albert": lambda: T.AlbertConfig(**common, **enc, embedding_size=16),
    }[family]()


def make_tiny_family(family: str, path, seed: int = 0):
    """A random <family>ForSequenceClassification folder with the tiny WordPiece tokenizer.json."""
    import torch
    from transformers import AutoModelForSequenceClassification

    make_tokenizer_dir(path)
    vocab = len((path / "vocab.txt").read_text().split())
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_config(_config(family, vocab))
    assert model.config.model_type == family
    model.save_pretrained(str(path), safe_serialization=True)
    return path


def _onnx_inputs(path):
    import onnx

    return list(onnx.load(str(path), load_external_data=False).graph.input)


def _write_csv(path, n: int, seed: int):
    import csv

    import numpy as np

    rng = np.random.default_rng(seed)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(("text", "label"))
        for i in range(n):
            label = ("billing", "praise")[i % 2]
            w.writerow((f"{label} " + " ".join(rng.choice(WORDS, 6)), label))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_encoder_linears_are_found_from_the_structure(family, tmp_path):
    from torch import nn
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.layers import encoder_layer_stack, encoder_linear_names

    model = AutoModelForSequenceClassification.from_pretrained(str(make_tiny_family(family, tmp_path / family)))
    stack, layers = encoder_layer_stack(model)
    expected = "distilbert.transformer.layer" if family == "distilbert" else f"{model.base_model_prefix}.encoder.layer"
    assert stack == expected
    names = encoder_linear_names(model)
    for i in range(len(layers)):  # Q, K, V, attention output, FFN in, FFN out in every layer
        assert len([n for n in names if n.startswith(f"{stack}.{i}.")]) == 6
    assert len(names) == 12
    linears = {n for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    dense = linears - set(names)  # the classifier head, pooler and ELECTRA's embedding projection stay dense
    assert dense and not any(n.startswith(f"{stack}.") for n in dense)


@pytest.mark.parametrize("family", FAMILIES)
def test_family_compresses_exports_evaluates_and_serves(family, tmp_path, capsys):
    from starlette.testclient import TestClient

    from holoserve.server.app import create_app
    from holoserve.server.config import ServerConfig

    base = make_tiny_family(family, tmp_path / family)
    train, dev = _write_csv(tmp_path / "train.csv", 48, 0), _write_csv(tmp_path / "dev.csv", 12, 1)
    data = ["--train", str(train), "--dev", str(dev)]
    out = tmp_path / "ckpt"
    assert main(["compress", "--model", str(base), "--out", str(out), *data, *FAST]) == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    assert m["sparsity"]["pattern"] == "2:4" and len(m["sparsity"]["layers"]) == 12
    assert main(["export", str(out), "--target", "all", *data, "--no-polygraphy"]) == 0, capsys.readouterr().err
    m = json.loads((out / "manifest.json").read_text())
    for key, entry in m["exports"].items():
        assert entry["quantized_linears"] == 12, key
        assert entry["verification"]["parity_vs_pytorch_fakequant"]["rows"] == 12, key
    ort = m["exports"]["onnxruntime"]
    assert ort["verification"]["parity_vs_pytorch_fakequant"]["max_abs_diff"] < 1e-4
    assert ort["attention"]["blocks"] == 2  # MPNet's relative-position bias rides along as the attention bias
    assert ort["fused_ops"]["classifier_row"]["row_nodes"] > 0 and ort["verification"]["dev_metric_diff_points"] == 0
    assert [i.name for i in _onnx_inputs(out / "model.onnx")] == ["input_ids", "attention_mask", "token_type_ids"]
    assert (out / "model.onnx").is_file() and (out / "model.trt.onnx").is_file()
    assert "dev predictions changed: 0 (allowed 1); right only here 0" in capsys.readouterr().out
    assert main(["eval", str(out), "--dev", str(dev), "--onnx"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["rows"] == 12 and 0.0 <= got["metrics"]["accuracy"] <= 1.0
    with TestClient(create_app(ServerConfig(artifact_dir=str(out), threads=1))) as c:
        deadline = time.monotonic() + 60
        while c.get("/readyz").status_code != 200 and time.monotonic() < deadline:
            time.sleep(0.05)  # the server loads the model in the background
        r = c.post("/predict", json={"texts": ["billing late again", "the film was great fun"]})
        assert r.status_code == 200, r.text
        assert {p["label"] for p in r.json()["predictions"]} <= {"billing", "praise"}


def test_albert_is_refused_up_front_with_the_supported_families(tmp_path, capsys):
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.layers import encoder_linear_names

    folder = make_tiny_family("albert", tmp_path / "albert")
    model = AutoModelForSequenceClassification.from_pretrained(str(folder))
    with pytest.raises(HoloServeError, match=r"ALBERT shares one layer's weights.*Supported encoder families: "
                                             r"BERT.*RoBERTa.*XLM-RoBERTa.*ELECTRA.*DistilBERT.*MPNet"):
        encoder_linear_names(model)
    train = _write_csv(tmp_path / "train.csv", 24, 0)
    out = tmp_path / "ckpt"
    assert main(["compress", "--model", str(folder), "--out", str(out), "--train", str(train), *FAST]) != 0
    err = capsys.readouterr().err
    assert "ALBERT" in err and "Supported encoder families" in err
    assert not (out / "manifest.json").exists()


def test_weights_shared_across_layers_are_refused_whatever_the_family(tmp_path):
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.layers import encoder_linear_names

    model = AutoModelForSequenceClassification.from_pretrained(str(make_tiny_family("bert", tmp_path / "b")))
    layers = model.bert.encoder.layer
    layers[1].intermediate.dense = layers[0].intermediate.dense  # one Linear reused by two layers
    with pytest.raises(HoloServeError, match="shared across layers.*Supported encoder families"):
        encoder_linear_names(model)


def test_unknown_family_is_refused(tmp_path):
    import torch

    from holoserve.compress.layers import encoder_linear_names

    model = torch.nn.Sequential(torch.nn.Linear(4, 4))
    model.config = type("C", (), {"model_type": "deberta-v2"})()
    with pytest.raises(HoloServeError, match="'deberta-v2' is not supported.*Supported encoder families"):
        encoder_linear_names(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_swap_reaches_every_family_ffn(family, tmp_path):
    """activation=relu sets each family's own config key (DistilBERT: `activation`, the rest: `hidden_act`),
    every layer's FFN then computes ReLU, and the saved folder reloads as the same ReLU model."""
    import torch
    from transformers import AutoModelForSequenceClassification
    from transformers.activations import GELUActivation

    from holoserve.compress.layers import encoder_layer_stack
    from holoserve.compress.context import load_hf_classifier
    from holoserve.data.tasks import Task

    folder = make_tiny_family(family, tmp_path / family)
    task = Task("t", ("a", "b"))
    gelu, relu = load_hf_classifier(folder, task), load_hf_classifier(folder, task, "relu")
    key = "activation" if family == "distilbert" else "hidden_act"
    assert getattr(gelu.config, key) == "gelu" and getattr(relu.config, key) == "relu"

    def kinds(model):  # the activations inside the encoder layers (a head may keep its own, as ELECTRA's does)
        layers = encoder_layer_stack(model)[1]
        return [type(x) for x in layers.modules() if isinstance(x, (torch.nn.ReLU, torch.nn.GELU, GELUActivation))]

    assert kinds(relu) == [torch.nn.ReLU] * 2 and kinds(gelu) == [GELUActivation] * 2
    ids = torch.randint(4, 20, (2, 7))
    with torch.no_grad():
        a, b = gelu.eval()(input_ids=ids).logits, relu.eval()(input_ids=ids).logits
    assert not torch.allclose(a, b)  # same weights, another FFN non-linearity
    relu.save_pretrained(str(tmp_path / "saved"), safe_serialization=True)
    again = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved")).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, b)


@pytest.mark.parametrize("family", FAMILIES)
def test_activation_ramp_blends_every_family_ffn(family, tmp_path):
    """The activation ramp's pieces on each family: one blend per encoder layer, which computes the teacher's
    GELU exactly at alpha 0, ReLU exactly at 1 and their mix between; set_ffn_activation then leaves a plain
    ReLU model whose saved folder reloads as the same model."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.layers import (BlendedActivation, blend_ffn_activations, ffn_activation_slots,
                                           set_ffn_activation)
    from holoserve.compress.context import load_hf_classifier
    from holoserve.data.tasks import Task

    folder = make_tiny_family(family, tmp_path / family)
    task = Task("t", ("a", "b"))
    model, relu = load_hf_classifier(folder, task).eval(), load_hf_classifier(folder, task, "relu").eval()
    ids = torch.randint(4, 20, (2, 7))
    with torch.no_grad():
        gelu_logits, relu_logits = model(input_ids=ids).logits, relu(input_ids=ids).logits
    blends = blend_ffn_activations(model, "relu")
    assert len(blends) == 2 and all(isinstance(getattr(m, a), BlendedActivation)
                                    for m, a in ffn_activation_slots(model))
    assert blend_ffn_activations(model, "relu") == blends  # idempotent: a blend is not wrapped again
    x = torch.linspace(-4, 4, 101)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, gelu_logits)  # alpha 0: the teacher's activation
        blends[0].set_alpha(0.25)
        want = 0.75 * torch.nn.functional.gelu(x) + 0.25 * x.clamp_min(0)
        assert torch.allclose(blends[0](x), want, atol=1e-6)
        for b in blends:
            b.set_alpha(1.0)
        assert torch.equal(model(input_ids=ids).logits, relu_logits)  # alpha 1: ReLU alone
    assert "alpha" not in " ".join(model.state_dict())  # the schedule is not a weight
    set_ffn_activation(model, "relu")
    key = "activation" if family == "distilbert" else "hidden_act"
    assert getattr(model.config, key) == "relu" and not any(isinstance(m, BlendedActivation) for m in model.modules())
    model.save_pretrained(str(tmp_path / "saved"), safe_serialization=True)
    again = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved")).eval()
    with torch.no_grad():
        assert torch.equal(again(input_ids=ids).logits, relu_logits)


def test_distilbert_relu_student_compresses_and_exports(tmp_path, capsys):
    """The DistilBERT branch end to end: the checkpoint's config.json says `activation: relu`, and the export
    computes ReLU (no Erf) with ONNX Runtime agreeing with the PyTorch fake-quant model."""
    import onnx

    base = make_tiny_family("distilbert", tmp_path / "distilbert")
    train, dev = _write_csv(tmp_path / "train.csv", 48, 0), _write_csv(tmp_path / "dev.csv", 12, 1)
    data = ["--train", str(train), "--dev", str(dev)]
    out = tmp_path / "ckpt"
    assert main(["compress", "--model", str(base), "--out", str(out), *data, *FAST,
                 "--set", "activation=relu"]) == 0, capsys.readouterr().err
    assert json.loads((out / "config.json").read_text())["activation"] == "relu"
    assert json.loads((base / "config.json").read_text())["activation"] == "gelu"
    assert main(["export", str(out), "--target", "onnxruntime", *data, "--no-polygraphy"]) == 0, capsys.readouterr().err
    ops = {n.op_type for n in onnx.load(str(out / "model.onnx")).graph.node}
    assert "Relu" in ops and "Erf" not in ops
    ort = json.loads((out / "manifest.json").read_text())["exports"]["onnxruntime"]
    assert ort["verification"]["parity_vs_pytorch_fakequant"]["max_abs_diff"] < 1e-4
