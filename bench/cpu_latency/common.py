"""What the CPU latency scripts share: their output and timing options, the inputs they time, the engines'
sessions and runners, the NNCF INT8 baseline, and the machine's load around a run."""
from __future__ import annotations

import argparse
import os
from pathlib import Path

import numpy as np

from bench import dated_results
from bench.lib.report import write_record
from holoserve.core.ort import session


def output_options(ap: argparse.ArgumentParser, name: str) -> None:
    """--out and --name: the run writes NAME.json and NAME.md (and a plot) into --out."""
    ap.add_argument("--out", type=Path, help="output folder (default bench/results/<today>-<name>)")
    ap.add_argument("--name", default=name)


def shape_options(ap: argparse.ArgumentParser, batch: int) -> None:
    """--batch, --seq and --threads: the one input shape and thread count a script times."""
    ap.add_argument("--batch", type=int, default=batch)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)


def timing_options(ap: argparse.ArgumentParser, runs: int, runs_help: str | None = None) -> None:
    """--runs (timed runs per engine) and --warmup (the untimed runs before them)."""
    ap.add_argument("--runs", type=int, default=runs, help=runs_help)
    ap.add_argument("--warmup", type=int, default=5)


def parse(ap: argparse.ArgumentParser, argv) -> argparse.Namespace:
    """The parsed options, --out defaulting to today's results folder named after --name."""
    args = ap.parse_args(argv)
    args.out = args.out or dated_results(args.name)
    return args


def save(report: dict, args: argparse.Namespace, markdown) -> None:
    """The record and its page as --out/--name.{json,md}."""
    write_record(report, args.out, args.name, markdown)
    print(f"wrote {args.out / args.name}.{{json,md}}")


def require_openvino():
    """The openvino module, or exit saying how to install it (the scripts that need it time nothing else)."""
    try:
        import openvino
    except ImportError as e:
        raise SystemExit(f"OpenVINO is not installed ({e}): pip install 'holoserve[bench]'") from None
    return openvino


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []




def ort_session(path: Path, threads: int):
    # ORT's pool threads spin-wait inside a run and stop when it returns, as the server runs them: with engines
    # interleaved in one process on a small CPU, spinning after the run would starve the next engine's threads
    # (PyTorch at 2 threads measured 5x slower than at 1), and parking them inside it slows ORT itself.
    return session(path, threads=threads, spin="run", quiet=True)


def random_rows(rng, vocab: int, batch: int, seq: int, cls_id: int | None = None,
                sep_id: int | None = None) -> dict[str, np.ndarray]:
    """Full-length rows of random token ids, skipping the special/unused ids at the start of a BERT
    vocabulary; [CLS] ... [SEP] when both ids are given. No padding."""
    ids = rng.integers(min(1000, vocab // 2), vocab, size=(batch, seq), dtype=np.int64)
    if cls_id is not None and sep_id is not None:
        ids[:, 0], ids[:, -1] = cls_id, sep_id
    return {"input_ids": ids, "attention_mask": np.ones_like(ids), "token_type_ids": np.zeros_like(ids)}


def kernels_missing() -> str:
    """Why HoloServe's 2:4 kernels cannot run on this CPU, or "" where they can."""
    from holoserve.kernels import cpu_missing

    missing = cpu_missing()
    return f"this CPU lacks {', '.join(missing)}, which HoloServe's 2:4 kernels need (AVX-512 VNNI and VBMI)" \
        if missing else ""


def percentile(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def accuracy(run, batches, labels) -> float:
    """run: feed dict -> logits."""
    pred = np.concatenate([run(b) for b in batches]).argmax(1)
    return float((pred == labels).mean())


def ort_runner(sess):
    return lambda feed: sess.run(["logits"], feed)[0]


def openvino_runner(compiled):
    """feed dict -> logits through one infer request of an OpenVINO compiled model."""
    request = compiled.create_infer_request()
    names = [i.get_any_name() for i in compiled.inputs]
    out = compiled.outputs[0]

    def run(feed):
        return request.infer({n: feed[n] for n in names})[out]
    return run


def openvino_modules():
    """(openvino, nncf or None, reason nncf is missing) or raises ImportError when OpenVINO is missing."""
    import openvino

    try:
        import nncf
    except ImportError as e:
        return openvino, None, f"NNCF is not installed ({e}): pip install 'holoserve[bench]'"
    return openvino, nncf, ""


def nncf_int8(ov, nncf, fp32_onnx: Path, samples: list[dict], out: Path) -> Path:
    """The dense fp32 ONNX through NNCF post-training quantization, saved as OpenVINO IR at `out`."""
    import logging

    logging.getLogger("nncf").setLevel(logging.WARNING)
    model = ov.Core().read_model(str(fp32_onnx))
    q = nncf.quantize(model, nncf.Dataset(samples), model_type=nncf.ModelType.TRANSFORMER,
                      subset_size=len(samples))
    ov.save_model(q, str(out), compress_to_fp16=False)
    return out


def train_samples(art, tok, data_dir, rows: int):
    """(the first `rows` training rows of the checkpoint's task, tokenized one row per sample, task):
    the NNCF baseline's calibration set. Raises when the task or its training split is unavailable."""
    from holoserve.data.glue import read_split
    from holoserve.data.tasks import get_task
    from holoserve.export.reference import encode_batches

    task = get_task(art.task_name)
    found = read_split(task, "train", data_dir, limit=rows)
    if not found:
        raise RuntimeError("the training split is empty")
    return [b for _, b in encode_batches(tok, [r.text for r in found], [r.text_pair for r in found]
                                         if task.is_pair else None, batch_size=1)], task


def int8_gemms(compiled) -> dict:
    try:
        from holoserve.backends.openvino import gemm_precisions

        return gemm_precisions(compiled)
    except Exception as e:  # runtime info layout differs between OpenVINO releases
        return {"unknown": str(e)[:200]}
