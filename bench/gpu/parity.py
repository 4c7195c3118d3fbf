"""Section parity of bench/gpu/run.py: ours against the checkpoint's fake-quant model on the task's dev split."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from bench.gpu.harness import Run, log
from bench.gpu.models import load_packed_checkpoint

TARGET_AGREEMENT = 0.995
BATCH = 64  # rows per forward, each batch padded to its longest row


def _dev_examples(run: Run, task) -> tuple[list | None, str]:
    """The task's dev split from --carry's glue/ folder (cpu-smoke: synthetic sentences); (None, why) without one."""
    import numpy as np

    from holoserve.data.glue import read_split

    glue = Path(run.args.carry) / "glue"
    if (glue / task.folder / "dev.tsv").is_file():
        examples = read_split(task, "dev", glue)
        return examples, f"{task.folder} dev ({len(examples)} rows)"
    if run.smoke:
        from tests.helpers.tiny import WORDS

        rng = np.random.default_rng(0)
        examples = [type("E", (), {"text": " ".join(rng.choice(WORDS, 8)), "text_pair": None, "label": int(i % 2)})()
                    for i in range(24)]
        return examples, "24 synthetic sentences (cpu-smoke)"
    return None, f"no dev split under {glue}: run python -m bench.gpu.bundle with --data-dir"


def _encoder_infer(run: Run, enc):
    """infer(ids, mask, token types) -> logits (numpy) of a torch-cuda encoder."""
    import torch

    def infer(ids, mask, tt):
        with torch.no_grad():
            t = [torch.from_numpy(v).to(run.device) for v in (ids, mask, tt)]
            return enc(*t).float().cpu().numpy()
    return infer


def _candidates(run: Run, art) -> list[tuple[str, Any]]:
    """(name, infer) of each implementation compared; the first is the headline (the backend as served)."""
    import torch

    from holoserve.backends import torch_cuda as tc

    if run.smoke:
        return [("INT8 reference kernel (CPU), FP32", _encoder_infer(run, tc.encoder_from_artifact(
            art, linear=tc.LinearOptions(kernel="reference", dtype=torch.float32))))]
    from holoserve.backends import load_backend

    candidates: list[tuple[str, Any]] = []
    for precision in ("fp16", "fp32"):
        try:
            backend = load_backend("torch-cuda", art, precision=precision)
            candidates.append((f"torch-cuda backend, precision={precision} (2:4 INT8 cuSPARSELt + CUDA graphs)",
                               backend.infer))
        except Exception as e:  # noqa: BLE001
            log(f"parity: backend precision={precision} failed to load: {e}")
    try:  # cuSPARSELt called directly: dequant, bias, GELU and the FFN's second quantizer in the GEMM epilogues
        fused = tc.encoder_from_artifact(art, linear=tc.LinearOptions(
            kernel="cslt_fused", device=run.device, tuning=tc.Tuning(quantizer=tc.choose_quantizer("cuda")[0])),
            fusion=tc.Fusion(gelu_quant=True, ln_quant=True))
        candidates.append(("2:4 INT8 cslt_fused (cuSPARSELt epilogues: INT8 GELU codes from the FFN's first GEMM), "
                           "FP16, eager", _encoder_infer(run, fused)))
    except Exception as e:  # noqa: BLE001 - nvmath-python missing, or the library refused the epilogue
        log(f"parity: cslt_fused failed to build: {e}")
    # how sensitive the checkpoint is: exact integer GEMMs, FP32 elsewhere, a different summation order
    candidates.append(("exact INT8 reference (float64 accumulation), FP32, on the GPU",
                       _encoder_infer(run, tc.encoder_from_artifact(art, linear=tc.LinearOptions(
                           kernel="reference", dtype=torch.float32, device=run.device)))))
    return candidates


def _padded(tok, chunk):
    """Token ids, attention mask and token types of a batch of examples, padded to its longest row."""
    import numpy as np

    enc = tok.encode_batch([(e.text, e.text_pair) if e.text_pair is not None else e.text for e in chunk])
    n = max(len(e.ids) for e in enc)
    ids = np.zeros((len(enc), n), dtype=np.int64)
    mask = np.zeros_like(ids)
    tt = np.zeros_like(ids)
    for j, e in enumerate(enc):
        ids[j, :len(e.ids)] = e.ids
        mask[j, :len(e.ids)] = e.attention_mask
        tt[j, :len(e.ids)] = e.type_ids
    return ids, mask, tt


def _logits(run: Run, art, examples, candidates):
    """Every candidate's logits (None for one that failed), the reference's and the labels, over the examples."""
    import numpy as np
    import torch

    from holoserve.compress.checkpoint import load_model
    from holoserve.compress.quant import input_quantizers
    from holoserve.core.tokenizer import load_tokenizer

    tok = load_tokenizer(art.path, art.max_seq_length)  # batches are padded to their longest row here
    ref, _ = load_model(art.path)
    ref.to(run.device)
    got: dict[str, list | None] = {name: [] for name, _ in candidates}
    want, labels = [], []
    for i in range(0, len(examples), BATCH):
        chunk = examples[i:i + BATCH]
        ids, mask, tt = _padded(tok, chunk)
        for name, infer in candidates:
            try:
                got[name].append(np.asarray(infer(ids, mask, tt), dtype=np.float32))
            except Exception as e:  # noqa: BLE001 - keep the others
                got[name] = None
                candidates = [c for c in candidates if c[0] != name]
                log(f"parity: {name} failed: {e}")
        t = {k: torch.from_numpy(v).to(run.device) for k, v in
             (("input_ids", ids), ("attention_mask", mask), ("token_type_ids", tt))}
        with torch.no_grad(), input_quantizers(ref, art.activation_amax(), art.sparse_layers, exact=True):
            want.append(ref(**t).logits.float().cpu().numpy())
        labels += [e.label for e in chunk]
    return got, np.concatenate(want), np.asarray(labels)


def _compare(task, got: dict[str, list | None], w, y) -> dict[str, Any]:
    """Per candidate: logit differences, argmax agreement and accuracy against the reference, and the export's check."""
    import numpy as np

    from holoserve.data.metrics import prediction_check

    variants = {}
    for name, parts in got.items():
        if not parts:
            variants[name] = {"error": "failed (see log)"}
            continue
        g = np.concatenate(parts)
        diff = np.abs(g - w)
        variants[name] = {"max_abs_logit_diff": float(diff.max()), "mean_abs_logit_diff": float(diff.mean()),
                          "argmax_agreement": float((g.argmax(-1) == w.argmax(-1)).mean()),
                          "accuracy": float((g.argmax(-1) == y).mean())}
        # the export's rule for the same question: FP32 may change what rounding explains (1 % of the rows),
        # FP16 (a precision change on purpose) may change more rows but not the accuracy (McNemar)
        rec, why = prediction_check(task, g, w, y, precision_change="precision=fp16" in name)
        variants[name]["check"] = rec | {"passes": why is None} | ({"fails": why} if why else {})
        log(f"parity: {name}: agreement {variants[name]['argmax_agreement']:.4f}, "
            f"max |Δlogit| {variants[name]['max_abs_logit_diff']:.4f}, acc {variants[name]['accuracy']:.4f}")
    return variants


def section_parity(run: Run) -> dict[str, Any]:
    """Ours (the torch-cuda path; CPU reference kernel in cpu-smoke) vs the fake-quant model in fp32."""
    from holoserve.data.tasks import get_task

    art, _ = load_packed_checkpoint(run)
    task = get_task(art.task_name)
    examples, source = _dev_examples(run, task)
    if examples is None:
        return {"error": source}
    got, w, y = _logits(run, art, examples, _candidates(run, art))
    variants = _compare(task, got, w, y)
    head_name = next((n for n in got if "error" not in variants[n]), None)
    if head_name is None:
        return {"error": "no implementation produced logits", "variants": variants}
    head = variants[head_name]
    res = {
        "data": source, "ours": head_name,
        "reference": "checkpoint fake-quant model, integer-exact GEMMs (compress.quant.input_quantizers, exact=True)",
        "rows": int(len(y)), "max_abs_logit_diff": head["max_abs_logit_diff"],
        "mean_abs_logit_diff": head["mean_abs_logit_diff"], "argmax_agreement": head["argmax_agreement"],
        "accuracy_ours": head["accuracy"], "accuracy_reference": float((w.argmax(-1) == y).mean()),
        "manifest_metrics": art.manifest.metrics.compressed,
        "target_argmax_agreement": TARGET_AGREEMENT, "variants": variants,
    }
    res["meets_target"] = res["argmax_agreement"] >= TARGET_AGREEMENT
    return res
