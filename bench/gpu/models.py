"""The models the encoder, profile and parity sections time: the packed checkpoint unpacked, a tiny stand-in for
the CPU smoke run, BERT-base shapes with random weights, and transformers' BERT around a state dict."""
from __future__ import annotations

import tempfile
from pathlib import Path

from bench.gpu.harness import Run


def load_packed_checkpoint(run: Run):
    """The packed checkpoint of --carry unpacked into a temp folder (cpu-smoke: a tiny one built here)."""
    from bench.gpu.pack import WEIGHTS, pack, unpack
    from holoserve.core.artifact import load_artifact

    tmp = Path(tempfile.mkdtemp(prefix="holoserve-gpu-bench-"))
    if run.smoke:
        packed = tmp / "packed"
        pack(_tiny_checkpoint(tmp), packed)
    else:
        packed = Path(run.args.carry) / "checkpoint"
        if not (packed / WEIGHTS).is_file():
            raise FileNotFoundError(f"{packed} has no packed checkpoint: run python -m bench.gpu.bundle CHECKPOINT "
                                    "first and copy .carry here")
    art = unpack(packed, tmp / "ckpt")
    return load_artifact(art.path), packed


def _tiny_checkpoint(tmp: Path) -> Path:
    """cpu-smoke: a tiny BERT projected to 2:4 INT8, calibrated and saved like a real checkpoint."""
    import torch
    from transformers import AutoModelForSequenceClassification

    from holoserve.compress.checkpoint import CheckpointContents, save_checkpoint
    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.compress.quant import calibrate_amax
    from holoserve.data.tasks import get_task
    from tests.helpers.tiny import make_tiny_bert

    src = make_tiny_bert(tmp / "base", hidden=64, layers=2, heads=2, intermediate=128)
    model = AutoModelForSequenceClassification.from_pretrained(str(src)).eval()
    layers = encoder_linear_names(model)
    scales = project_layers(model, layers)
    vocab = model.config.vocab_size
    batches = [token_batch(torch, 4, 16, vocab, "cpu", seed=s) for s in range(2)]
    amax = calibrate_amax(model, layers, batches)
    save_checkpoint(model, src, tmp / "tiny", CheckpointContents(
        task=get_task("sst2"), base_model="tiny-random-bert", max_seq_length=64, sparse_layers=layers,
        weight_scales=scales, act_amax=amax))
    return tmp / "tiny"


def token_batch(torch, b: int, n: int, vocab: int, device, seed: int | None = None, gen=None):
    if gen is None:
        gen = torch.Generator(device=device).manual_seed(seed or 0)
    lo = min(1000, max(5, vocab // 2))
    ids = torch.randint(lo, vocab, (b, n), device=device, generator=gen)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "token_type_ids": torch.zeros_like(ids)}


def bert_base_random(run: Run):
    """BERT-base shapes (12 x 768, FFN 3072) with random weights: dense state, and a 2:4 INT8 version.
    Built (and calibrated) once per run: the encoder and profile sections share it."""
    if getattr(run, "bert_base", None) is None:
        run.bert_base = _build_bert_base_random(run)
    return run.bert_base


def _build_bert_base_random(run: Run):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from holoserve.compress.layers import encoder_linear_names
    from holoserve.compress.sparsify import project_layers
    from holoserve.compress.quant import calibrate_amax

    if run.smoke:
        cfg = BertConfig(vocab_size=2000, hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=128, max_position_embeddings=128, num_labels=2)
    else:
        cfg = BertConfig(num_labels=2)  # bert-base-uncased shapes
    torch.manual_seed(0)
    model = BertForSequenceClassification(cfg).eval()
    dense_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    layers = encoder_linear_names(model)
    scales = project_layers(model, layers)
    model.to(run.device)
    batches = [token_batch(torch, 8, run.args.seq, cfg.vocab_size, run.device, seed=s) for s in range(4)]
    amax = calibrate_amax(model, layers, batches)
    sparse_state = {k: v.detach().cpu() for k, v in model.state_dict().items()}
    del model
    return cfg.to_dict(), dense_state, sparse_state, {"scales": scales, "amax": amax, "layers": layers}


def hf_model(config: dict, state: dict, dtype, device):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    cfg = BertConfig(**{k: v for k, v in config.items() if k not in ("architectures", "transformers_version")})
    try:
        cfg._attn_implementation = "sdpa"
    except Exception:  # noqa: BLE001 - older/newer transformers choose their own default
        pass
    with torch.device(device):  # random init on the device is quick; every weight is overwritten below
        model = BertForSequenceClassification(cfg)
    missing, unexpected = model.load_state_dict(dict(state), strict=False)
    missing = [k for k in missing if not k.endswith("position_ids")]
    if missing or unexpected:
        raise RuntimeError(f"state dict does not fit BertForSequenceClassification: missing {missing[:5]}, "
                           f"unexpected {unexpected[:5]}")
    return model.to(device=device, dtype=dtype).eval()
