"""CPU latency, side by side in one run: PyTorch fp32 eager, ORT fp32 and dynamic INT8, OpenVINO fp32 and NNCF INT8, ours.

    python -m bench.cpu_latency.run CHECKPOINT [--dense HF_FOLDER] [--data-dir GLUE_DIR]

- "ours": the checkpoint's exported model.onnx (`holoserve export`: 2:4 weights, static INT8 QDQ
  fused by ONNX Runtime into integer MatMuls), and its `openvino` export (model.ov.onnx,
  `holoserve export CKPT --target openvino`) compiled by OpenVINO through the OpenVINO backend;
  skipped, with the reason printed and recorded, where the checkpoint has no such export.
- baselines come from the dense fine-tuned model (--dense, e.g. the teacher the compressor saved;
  default: the checkpoint's own fp32 weights): PyTorch fp32 in eager mode, its fp32 ONNX export in
  ONNX Runtime, and that export after onnxruntime.quantization.quantize_dynamic (int8 weights,
  dynamic activation ranges: what Optimum's dynamic quantization produces; it also makes the
  attention MatMuls integer). --fuse-baseline-attention gives both ORT baselines the attention
  fusion ours gets (export/fusion.py) instead, --baseline-classifier-row the last layer computed for
  the [CLS] row only, as ours has it.
- OpenVINO baselines, also from the dense model: its plain fp32 ONNX export (no ORT rewrites;
  OpenVINO does its own fusions) compiled by OpenVINO's CPU plugin, and that model after NNCF
  post-training quantization (nncf.quantize, model_type TRANSFORMER, subset_size 64, on the first
  --calibration-rows training rows of the task, tokenized as for dev accuracy, one row per sample;
  weights stay dense). Both compiled with PERFORMANCE_HINT LATENCY and INFERENCE_NUM_THREADS =
  --threads. OpenVINO and NNCF are optional (`pip install 'holoserve[bench]'`): without them
  those engines are skipped with a message; --skip leaves out any engine but PyTorch.
- static-shape rows: ours through the OpenVINO backend's static shapes (`--openvino-shapes`), and the NNCF
  INT8 IR reshaped alike, each compiled for every cell's (batch, seq); OpenVINO fuses more of the graph
  when every dimension is static. The report gives their ratio per cell; they get no dev accuracy (the
  models are their dynamic rows').
- f32 rows: ours on OpenVINO (dynamic and static) with `--openvino-precision f32`, the numerics of
  `holoserve eval`; OpenVINO's default runs the float ops in bf16 where the CPU has bf16 units.
- kernel rows: ours on OpenVINO with `--openvino-kernels on` (HoloServe's 2:4 kernels, holoserve.kernels),
  dynamic and static; skipped with the reason on a CPU without AVX-512 VNNI and VBMI.
- --also CKPT: a second compressed checkpoint (e.g. one trained with `--set activation=relu` from the
  same teacher), its `openvino` export timed like ours (dynamic and static rows) in the same run, so
  that two recipes compare on the same inputs and load; it gets a dev accuracy like every engine.
- batch 1/8/32 x sequence 32/128 x 1 and 2 threads; every run uses full-length rows of random
  token ids; median and p90 over --runs timed runs after --warmup runs, the engines interleaved
  per shape so that background load hits them alike. Also SST-2 (or the checkpoint's task) dev
  accuracy of every engine but PyTorch eager (whose weights the ORT fp32 export holds).
Writes bench/results/<today>-NAME/NAME.{json,md,png} (--name, default cpu_latency; --out). The machine is shared: `uptime` load averages
before and after are recorded.
"""
from __future__ import annotations

import argparse
import os
import shutil
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np


from bench import dated_results  # noqa: E402
from holoserve.backends.openvino import inference_precision as openvino_inference_precision  # noqa: E402
from holoserve.core.files import atomic_savefig  # noqa: E402
from holoserve.core.machine import describe_cpu  # noqa: E402
from holoserve.core.ort import session  # noqa: E402

ENGINES = ("pytorch_fp32", "ort_fp32", "ort_dynamic_int8", "openvino_fp32", "openvino_nncf_int8",
           "openvino_nncf_int8_static", "ours_qdq_int8", "ours_openvino", "ours_openvino_sparse",
           "ours_openvino_static", "ours_openvino_f32", "ours_openvino_static_f32", "ours_openvino_kernels",
           "ours_openvino_static_kernels", "also_openvino", "also_openvino_static")
LABELS = {
    "pytorch_fp32": "PyTorch fp32 (eager)",
    "ort_fp32": "ORT fp32",
    "ort_dynamic_int8": "ORT dynamic INT8",
    "openvino_fp32": "OpenVINO fp32",
    "openvino_nncf_int8": "OpenVINO INT8 (NNCF PTQ)",
    "ours_qdq_int8": "ours: 2:4 + static INT8 (ORT)",
    "ours_openvino": "ours on OpenVINO",
    # the same model with OpenVINO's sparse-weight decompression on: beside the row above (the backend's
    # default, off) it shows what the 2:4 zeros buy where the CPU has AMX; where it has none, both run dense
    "ours_openvino_sparse": "ours on OpenVINO, sparse-weight decompression on",
    "ours_openvino_dense": "ours on OpenVINO, sparse-weight decompression off",  # reports before 2026-11-25
    # compiled for each cell's one shape: OpenVINO fuses more with every dimension static. Ours through the
    # backend's --openvino-shapes; the NNCF baseline gets the same treatment, so the pair compares alike
    "openvino_nncf_int8_static": "OpenVINO INT8 (NNCF PTQ), static shape",
    "ours_openvino_static": "ours on OpenVINO, static shape",
    # --openvino-precision f32: the float ops in float32, `holoserve eval`'s numerics (OpenVINO's CPU default
    # is bf16 where the CPU has bf16 units, which moves some predictions), at the speed this costs
    "ours_openvino_f32": "ours on OpenVINO, f32 float ops",
    "ours_openvino_static_f32": "ours on OpenVINO, static shape, f32 float ops",
    # --openvino-kernels on: the 2:4 INT8 Linears on HoloServe's own kernels (holoserve.kernels), which skip
    # the zeros; every other op stays OpenVINO's
    "ours_openvino_kernels": "ours on OpenVINO + 2:4 kernels",
    "ours_openvino_static_kernels": "ours on OpenVINO + 2:4 kernels, static shape",
    # --also: a second checkpoint's OpenVINO export, through the same backend as ours
    "also_openvino": "second checkpoint (--also) on OpenVINO",
    "also_openvino_static": "second checkpoint (--also) on OpenVINO, static shape",
}
# static-shape rows and the dynamic row whose model they compile per cell
STATIC_OF = {"openvino_nncf_int8_static": "openvino_nncf_int8", "ours_openvino_static": "ours_openvino",
             "ours_openvino_static_f32": "ours_openvino_f32", "ours_openvino_static_kernels": "ours_openvino_kernels",
             "also_openvino_static": "also_openvino"}
# our model.ov.onnx compiled by OpenVINO once for all shapes (the static rows compile it per cell)
OURS_OPENVINO = ("ours_openvino", "ours_openvino_sparse", "ours_openvino_f32", "ours_openvino_kernels")
KERNEL_ROWS = ("ours_openvino_kernels", "ours_openvino_static_kernels")  # --openvino-kernels on
OPENVINO_ENGINES = ("openvino_fp32", "openvino_nncf_int8", *OURS_OPENVINO, "also_openvino")
PRECISION_OF = {"ours_openvino_f32": "f32", "ours_openvino_static_f32": "f32"}  # others: OpenVINO's default
INT8_REFERENCE = "openvino_nncf_int8"  # the second ratio in the table: speed-up over OpenVINO INT8 (NNCF)


def load_avg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def uptime_text() -> str:
    try:
        return subprocess.run(["uptime"], capture_output=True, text=True, timeout=5).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def ort_session(path: Path, threads: int):
    # ORT's pool threads spin-wait after each run; with engines interleaved in one process on a
    # small CPU that spinning starves the next engine's threads (PyTorch at 2 threads measured
    # 5x slower than at 1). Parked threads keep the comparison fair.
    return session(path, threads=threads, spinning=False, quiet=True)


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


def skip_static_rows(skipped: dict) -> None:
    """A static-shape row is skipped, for the same reason, when the row whose model it compiles is."""
    for k, base in STATIC_OF.items():
        if base in skipped:
            skipped.setdefault(k, skipped[base])


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


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.run", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint", type=Path)
    ap.add_argument("--also", type=Path, default=None,
                    help="a second compressed checkpoint of the same task whose OpenVINO export is timed beside ours")
    ap.add_argument("--dense", type=Path, default=None,
                    help="dense fine-tuned HF folder for the baselines (default: the checkpoint's own fp32 weights)")
    ap.add_argument("--data-dir", default=None, help="GLUE data dir for dev accuracy and the NNCF calibration rows (or $HOLOSERVE_DATA_DIR)")
    ap.add_argument("--out", type=Path, help="output folder (default bench/results/<today>-<name>)")
    ap.add_argument("--name", default="cpu_latency")
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--seqs", default="32,128")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--dev-rows", type=int, default=None)
    ap.add_argument("--calibration-rows", type=int, default=64,
                    help="training rows NNCF calibrates the OpenVINO INT8 baseline on (its subset_size)")
    ap.add_argument("--skip", default="",
                    help=f"comma-separated engines to leave out, of {', '.join(ENGINES[1:])}")
    ap.add_argument("--fuse-baseline-attention", action="store_true",
                    help="give the ORT baselines the MultiHeadAttention fusion ours gets (before dynamic "
                         "quantization). Default: attention as exported, which dynamic quantization turns into "
                         "integer MatMuls; on a 2-core x86 CPU that was the faster dynamic INT8 baseline at "
                         "sequence 32 and no slower at 128")
    ap.add_argument("--baseline-classifier-row", action="store_true",
                    help="give the ORT baselines the classifier-row rewrite ours gets (the last layer computed "
                         "for the [CLS] row only; before dynamic quantization). Without --fuse-baseline-attention "
                         "it stops at the attention output, as attention is then not one node")
    args = ap.parse_args(argv)
    args.out = args.out or dated_results(args.name)
    skipped = {}  # engine -> why it was not run
    for k in filter(None, (x.strip() for x in args.skip.split(","))):
        if k not in ENGINES[1:]:
            raise SystemExit(f"--skip {k}: not an engine (choose from {', '.join(ENGINES[1:])})")
        skipped[k] = "left out (--skip)"
    if args.runs < 30:
        print("note: fewer than 30 timed runs per cell", file=sys.stderr)

    import torch
    from onnxruntime.quantization import QuantType, quantize_dynamic
    from transformers import AutoModelForSequenceClassification

    from holoserve.export.onnx_export import torch_export_fp32
    from holoserve.export.reference import encode_batches, make_tokenizer
    from holoserve.core.artifact import load_artifact

    art = load_artifact(args.checkpoint)
    ours = art.export_path("onnxruntime")
    if ours is None or not ours.is_file():
        raise SystemExit(f"{art.path} has no ONNX Runtime export: run `holoserve export {art.path}` first")
    ours_ov = art.export_path("openvino")
    for key in OURS_OPENVINO:
        if key not in skipped and (ours_ov is None or not ours_ov.is_file()):
            skipped[key] = (f"{art.path.name} has no OpenVINO export (model.ov.onnx): run "
                            f"`holoserve export {art.path.name} --target openvino` to time ours on OpenVINO")
    art_also = also_ov = None
    if args.also is None:
        skipped.setdefault("also_openvino", "no --also checkpoint given")
    elif "also_openvino" not in skipped:
        art_also = load_artifact(args.also)
        also_ov = art_also.export_path("openvino")
        if also_ov is None or not also_ov.is_file():
            raise SystemExit(f"--also {args.also}: it has no OpenVINO export (model.ov.onnx): run "
                             f"`holoserve export {args.also} --target openvino` first")
        if art_also.task_name != art.task_name:
            raise SystemExit(f"--also {args.also}: its task is {art_also.task_name!r}, the checkpoint's "
                             f"{art.task_name!r}; compare checkpoints of one task")
    ov = nncf = None
    if any(k not in skipped for k in OPENVINO_ENGINES):
        try:
            ov, nncf, why = openvino_modules()
            if nncf is None:
                skipped.setdefault("openvino_nncf_int8", why)
        except ImportError as e:
            for k in OPENVINO_ENGINES:
                skipped.setdefault(k, f"OpenVINO is not installed ({e}): pip install 'holoserve[bench]'")
    no_kernels = kernels_missing()
    if no_kernels:  # --openvino-kernels on refuses such a CPU; the static row follows its dynamic one below
        skipped.setdefault("ours_openvino_kernels", no_kernels)
    skip_static_rows(skipped)
    for k, why in skipped.items():
        print(f"skipping {LABELS[k]}: {why}", flush=True)
    dense_dir = args.dense or art.path
    started = datetime.now(timezone.utc)
    uptime_before, load_before = uptime_text(), load_avg()

    work = Path(tempfile.mkdtemp(prefix="holoserve-bench-"))
    print(f"exporting the dense baselines from {dense_dir.name} ...", flush=True)
    dense_eager = AutoModelForSequenceClassification.from_pretrained(str(dense_dir), local_files_only=True,
                                                                     attn_implementation="eager").eval()
    fp32_onnx = work / "dense.fp32.onnx"
    torch_export_fp32(dense_eager, fp32_onnx)
    plain_fp32_onnx = work / "dense.fp32.plain.onnx"  # OpenVINO's input: as exported, standard ops only
    shutil.copyfile(fp32_onnx, plain_fp32_onnx)
    baseline_attention = "as exported (MatMul, Softmax)"
    baseline_classifier_row = "all rows computed"
    if args.fuse_baseline_attention or args.baseline_classifier_row:
        import onnx

        from holoserve.export.fusion import CONTRIB, FUSED_OP, fuse_attention, tensor_ranks
        from holoserve.export.standard_rewrites import keep_classifier_row

        m = onnx.load(str(fp32_onnx))
        ranks = tensor_ranks(m) if args.baseline_classifier_row else {}  # before contrib ops hide shapes
        if args.fuse_baseline_attention:
            fused = fuse_attention(m, int(dense_eager.config.num_attention_heads))
            baseline_attention = f"{fused} blocks fused into {CONTRIB}.{FUSED_OP}, as in ours"
        if args.baseline_classifier_row:
            got = keep_classifier_row(m, ranks)
            baseline_classifier_row = f"last layer on the [CLS] row only, as in ours ({got['row_nodes']} nodes)"
        onnx.save(m, str(fp32_onnx))
    dyn_onnx = work / "dense.dynamic-int8.onnx"
    if "ort_dynamic_int8" not in skipped:
        quantize_dynamic(str(fp32_onnx), str(dyn_onnx), weight_type=QuantType.QInt8)
    del dense_eager
    # PyTorch as users run it: default attention implementation, eval mode, inference_mode
    dense = AutoModelForSequenceClassification.from_pretrained(str(dense_dir), local_files_only=True).eval()
    sizes = {
        "fp32_onnx_bytes": fp32_onnx.stat().st_size,
        "dynamic_int8_onnx_bytes": dyn_onnx.stat().st_size if dyn_onnx.is_file() else None,
        "ours_onnx_bytes": ours.stat().st_size,
        "ours_openvino_onnx_bytes": ours_ov.stat().st_size if "ours_openvino" not in skipped else None,
        "also_openvino_onnx_bytes": also_ov.stat().st_size if also_ov is not None else None,
    }

    tok = make_tokenizer(art)
    task = None
    try:
        from holoserve.data.tasks import get_task

        task = get_task(art.task_name)
    except Exception as e:
        print(f"note: task {art.task_name!r} unknown ({e}): no dev accuracy or calibration rows", file=sys.stderr)

    # ---------------------------------------------------------------- OpenVINO INT8 baseline (NNCF PTQ)
    nncf_ir = work / "dense.nncf-int8.xml"
    calibration = {}
    if "openvino_nncf_int8" not in skipped:
        try:
            samples, task = train_samples(art, tok, args.data_dir, args.calibration_rows)
        except Exception as e:  # no data dir: nothing to calibrate on
            skipped["openvino_nncf_int8"] = f"no {art.task_name} training rows to calibrate on ({str(e)[:300]})"
            print(f"skipping {LABELS['openvino_nncf_int8']}: {skipped['openvino_nncf_int8']}", flush=True)
        else:
            print(f"NNCF post-training quantization of the dense model on {len(samples)} {task.name} training rows ...",
                  flush=True)
            t0 = time.perf_counter()
            nncf_int8(ov, nncf, plain_fp32_onnx, samples, nncf_ir)
            calibration = {"rows": len(samples), "split": "train", "task": task.name, "first_rows": True,
                           "seconds": round(time.perf_counter() - t0, 1)}
            sizes["openvino_nncf_int8_ir_bytes"] = nncf_ir.stat().st_size + nncf_ir.with_suffix(".bin").stat().st_size
    skip_static_rows(skipped)
    engines = [k for k in ENGINES if k not in skipped]
    onnx_of = {"ort_fp32": fp32_onnx, "ort_dynamic_int8": dyn_onnx, "ours_qdq_int8": ours}
    openvino_of = {"openvino_fp32": (plain_fp32_onnx, False), "openvino_nncf_int8": (nncf_ir, False),  # (model,
                   **{k: (ours_ov, k == "ours_openvino_sparse") for k in OURS_OPENVINO},  # sparse decompression)
                   "also_openvino": (also_ov, False)}

    def compile_ov(key: str, threads: int):
        from holoserve.backends.openvino import compile_model

        path, sparse = openvino_of[key]
        compiled, note = compile_model(path, threads=threads, sparse=sparse, precision=PRECISION_OF.get(key, "auto"),
                                       kernels="on" if key in KERNEL_ROWS else "off")
        return compiled, note

    def static_runner(key: str, threads: int, batch: int, seq: int):
        """feed -> logits for a static-shape row, compiled for this one cell."""
        from holoserve.backends.openvino import OpenVinoBackend, compile_model

        if key != "openvino_nncf_int8_static":  # ours: the product path, the backend with --openvino-shapes
            backend = OpenVinoBackend(art_also if key == "also_openvino_static" else art, threads=threads, shapes=[(batch, seq)],
                                      precision=PRECISION_OF.get(key, "auto"),
                                      kernels="on" if key in KERNEL_ROWS else "off")
            run = (lambda feed: backend.infer(feed["input_ids"], feed["attention_mask"], feed["token_type_ids"]))
            return run, backend
        return openvino_runner(compile_model(nncf_ir, threads=threads, sparse=False, shape=(batch, seq))[0]), None

    def runners(threads: int) -> dict:
        out = {}
        for k in engines:
            if k in onnx_of:
                out[k] = ort_runner(ort_session(onnx_of[k], threads))
            elif k in openvino_of:
                out[k] = openvino_runner(compile_ov(k, threads)[0])
        return out

    openvino_info = {}
    if ov is not None and any(k in engines for k in OPENVINO_ENGINES):
        openvino_info = {"version": ov.__version__, "nncf": getattr(nncf, "__version__", None),
                         "config": "PERFORMANCE_HINT LATENCY, INFERENCE_NUM_THREADS = threads"}
        for k in OPENVINO_ENGINES:
            if k in engines:
                compiled, note = compile_ov(k, 1)
                openvino_info[k] = {"gemm_precisions": int8_gemms(compiled), "sparse_weights_decompression": note,
                                    "inference_precision": openvino_inference_precision(compiled)}

    # ---------------------------------------------------------------- accuracy (dev, through ORT)
    acc = {}
    try:
        from holoserve.data.glue import read_split

        if task is None:
            raise RuntimeError(f"no task for {art.task_name!r}")
        rows = read_split(task, "dev", args.data_dir, limit=args.dev_rows)
        idx_b = list(encode_batches(tok, [r.text for r in rows], [r.text_pair for r in rows] if task.is_pair else None))
        order = np.concatenate([np.asarray(i) for i, _ in idx_b])
        labels = np.asarray([r.label for r in rows])[order]
        batches = [b for _, b in idx_b]
        for key, run in runners(2).items():
            acc[key] = accuracy(run, batches, labels)
        acc["task"], acc["rows"] = task.name, len(rows)
        acc["max_seq_length"] = art.max_seq_length
        print("dev accuracy:", {k: v for k, v in acc.items()}, flush=True)
    except Exception as e:  # no data dir: latency only
        acc = {"skipped": str(e)}

    # ---------------------------------------------------------------- latency
    batches_ = [int(x) for x in args.batches.split(",")]
    seqs = [int(x) for x in args.seqs.split(",")]
    threads_ = [int(x) for x in args.threads.split(",")]
    rng = np.random.default_rng(0)
    vocab = dense.config.vocab_size
    cls_id, sep_id = tok.token_to_id("[CLS]"), tok.token_to_id("[SEP]")
    results = []
    for th in threads_:
        torch.set_num_threads(th)
        engine_runs = runners(th)
        for b in batches_:
            for s in seqs:
                feed = random_rows(rng, vocab, b, s, cls_id, sep_id)
                tfeed = {k: torch.from_numpy(v) for k, v in feed.items()}

                def run_torch():
                    with torch.inference_mode():
                        dense(**tfeed)

                fns = {"pytorch_fp32": run_torch}
                static_backends = {}
                for k in engines:
                    if k in STATIC_OF:
                        run, static_backends[k] = static_runner(k, th, b, s)
                        engine_runs[k] = run
                for k in engines[1:]:
                    fns[k] = (lambda run=engine_runs[k]: run(feed))
                for fn in fns.values():
                    for _ in range(args.warmup):
                        fn()
                times = {k: [] for k in fns}
                order = list(fns.items())
                for i in range(args.runs):
                    # interleaved, so background load hits every engine alike, and in reverse order every
                    # other round: an engine timed right after a similar one ran up to 12 % faster at batch 1
                    # on a 2-core Xeon (docs/results/2026-11-24-openvino.md), a bias the reversal cancels
                    for k, fn in (order if i % 2 == 0 else order[::-1]):
                        t0 = time.perf_counter()
                        fn()
                        times[k].append((time.perf_counter() - t0) * 1000.0)
                row = {"threads": th, "batch": b, "seq": s}
                for k, backend in static_backends.items():
                    if backend is not None and backend.runs["static"] == 0:  # the cell must have run static
                        raise RuntimeError(f"{LABELS[k]} never ran its static model: {backend.runs}")
                for k in engines:
                    row[k] = {"median_ms": round(percentile(times[k], 50), 3), "p90_ms": round(percentile(times[k], 90), 3)}
                base = row["pytorch_fp32"]["median_ms"]
                row["speedup_vs_pytorch_fp32"] = {k: round(base / row[k]["median_ms"], 2) for k in engines}
                if INT8_REFERENCE in engines:
                    ref = row[INT8_REFERENCE]["median_ms"]
                    row[f"speedup_vs_{INT8_REFERENCE}"] = {k: round(ref / row[k]["median_ms"], 2) for k in engines}
                results.append(row)
                print(f"threads {th} batch {b:>2} seq {s:>3}: " + "  ".join(
                    f"{k} {row[k]['median_ms']:.1f}ms (x{row['speedup_vs_pytorch_fp32'][k]})" for k in engines), flush=True)

    import onnxruntime

    report = {
        "benchmark": "cpu_latency",
        "date": started.date().isoformat(),
        "started": started.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": describe_cpu(),
        "load": {"uptime_before": uptime_before, "uptime_after": uptime_text(), "loadavg_before": load_before,
                 "loadavg_after": load_avg(),
                 "note": "shared machine: other jobs may have been running during the measurement"},
        "versions": {"torch": torch.__version__, "onnxruntime": onnxruntime.__version__, "python": platform.python_version(),
                     **({"openvino": openvino_info["version"], "nncf": openvino_info["nncf"]} if openvino_info else {})},
        "checkpoint": art.path.name,
        "also_checkpoint": art_also.path.name if art_also is not None else None,
        "dense_baseline": dense_dir.name,
        "method": {"runs": args.runs, "warmup": args.warmup, "inputs": "random token ids, full-length rows (no padding)",
                   "interleaved": "every round, the order reversed every other round", "dynamic_int8": "onnxruntime.quantization.quantize_dynamic(weight_type=QInt8)",
                   "baseline_attention": baseline_attention,
                   "baseline_classifier_row": baseline_classifier_row,
                   "openvino_baselines": "the dense fp32 ONNX as exported (standard ops, no ORT rewrites), compiled "
                                         "by OpenVINO; INT8: nncf.quantize(model_type=TRANSFORMER, subset_size="
                                         f"{args.calibration_rows}) on the first training rows, dense weights",
                   "static_shape_rows": "compiled for each cell's (batch, seq) alone; ours through the OpenVINO "
                                        "backend's static shapes (--openvino-shapes), NNCF's IR reshaped to the "
                                        "cell; no dev accuracy (the same models as their dynamic rows)",
                   "nncf_calibration": calibration},
        "engines": engines,
        "skipped_engines": skipped,
        "openvino": openvino_info,
        "sizes": sizes,
        "dev_accuracy": acc,
        "results": results,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    from holoserve.core.files import atomic_write_json, atomic_write_text

    atomic_write_json(args.out / f"{args.name}.json", report)
    atomic_write_text(args.out / f"{args.name}.md", markdown(report))
    plot(report, args.out / f"{args.name}.png")
    print(f"wrote {args.out / args.name}.{{json,md,png}}")
    shutil.rmtree(work, ignore_errors=True)
    return 0


def report_engines(r: dict) -> list[str]:
    """The engines a report timed (reports written before OpenVINO joined have the first four)."""
    return list(r.get("engines") or ("pytorch_fp32", "ort_fp32", "ort_dynamic_int8", "ours_qdq_int8"))


def markdown(r: dict) -> str:
    engines = report_engines(r)
    versions = ", ".join(f"{k} {v}" for k, v in r["versions"].items() if k != "python" and v)
    lines = [f"# CPU latency — {r['date']}, {r['machine']}", "",
             f"Checkpoint `{r['checkpoint']}`"
             + (f", second checkpoint (--also) `{r['also_checkpoint']}`" if r.get("also_checkpoint") else "")
             + f"; baselines from `{r['dense_baseline']}`. "
             f"Median / p90 of {r['method']['runs']} runs after {r['method']['warmup']} warm-up runs, engines "
             f"interleaved (the order reversed every other round), full-length rows. {versions}. "
             f"Attention in the ORT baselines: {r['method'].get('baseline_attention', 'as exported')}; "
             f"their last layer: {r['method'].get('baseline_classifier_row', 'all rows computed')}.",
             f"Load before: `{r['load']['uptime_before']}`; after: `{r['load']['uptime_after']}` "
             "(shared machine: other jobs may have been running).", ""]
    if any(k in engines for k in OPENVINO_ENGINES):
        cal = r["method"].get("nncf_calibration") or {}
        lines += [f"OpenVINO baselines: {r['method']['openvino_baselines']}"
                  + (f" ({cal['rows']} {cal['task']} rows, {cal['seconds']} s)" if cal else "")
                  + f"; compiled with {r['openvino']['config']}, other settings OpenVINO's defaults.", ""]
        prec = [f"{LABELS[k]} {r['openvino'][k]['gemm_precisions']}, float ops in "
                f"{r['openvino'][k].get('inference_precision', '?')}" for k in OPENVINO_ENGINES if k in r["openvino"]]
        lines += ["OpenVINO GEMM precisions (compiled graph): " + "; ".join(prec) + ".", ""]
    for k, why in (r.get("skipped_engines") or {}).items():
        lines += [f"Not run: {LABELS[k]} — {why}.", ""]
    acc = r["dev_accuracy"]
    if "skipped" not in acc:
        got = ", ".join(f"{LABELS[k]} {100 * acc[k]:.2f}" for k in engines if k in acc)
        lines += [f"{acc['task']} dev accuracy ({acc['rows']} rows, max_seq_length {acc['max_seq_length']}; "
                  f"ORT fp32 holds the PyTorch weights): {got}.", ""]
    else:
        lines += [f"Dev accuracy not measured: {acc['skipped']}", ""]
    s = r["sizes"]
    names = {"fp32_onnx_bytes": "fp32 ONNX", "dynamic_int8_onnx_bytes": "dynamic INT8 ONNX",
             "openvino_nncf_int8_ir_bytes": "NNCF INT8 IR", "ours_onnx_bytes": "ours (model.onnx)",
             "ours_openvino_onnx_bytes": "ours (model.ov.onnx)", "also_openvino_onnx_bytes": "second (model.ov.onnx)"}
    lines += ["Sizes: " + ", ".join(f"{names.get(k, k)} {v / 1e6:.1f} MB" for k, v in s.items() if v) + ".", ""]
    ref = f"speedup_vs_{INT8_REFERENCE}"
    has_ref = any(ref in x for x in r["results"])
    for th in sorted({x["threads"] for x in r["results"]}):
        lines += [f"## {th} thread{'s' if th > 1 else ''} — median ms (p90 ms), speed-up vs PyTorch fp32"
                  + (f" / vs {LABELS[INT8_REFERENCE]}" if has_ref else ""), "",
                  "| batch | seq | " + " | ".join(LABELS[k] for k in engines) + " |",
                  "|---:|---:|" + "---:|" * len(engines)]
        for x in r["results"]:
            if x["threads"] != th:
                continue
            cells = [f"{x[k]['median_ms']:.1f} ({x[k]['p90_ms']:.1f}) ×{x['speedup_vs_pytorch_fp32'][k]:.2f}"
                     + (f" / ×{x[ref][k]:.2f}" if ref in x else "") for k in engines]
            lines.append(f"| {x['batch']} | {x['seq']} | " + " | ".join(cells) + " |")
        lines.append("")
        peer = "openvino_nncf_int8_static"
        for ours_static in ("ours_openvino_static", "ours_openvino_static_f32", "ours_openvino_static_kernels",
                            "also_openvino_static"):
            pair = [x for x in r["results"] if x["threads"] == th and peer in x and ours_static in x]
            if pair:  # the like-for-like ratio: both compiled for the cell's shape
                lines += [f"{LABELS[ours_static]} vs {LABELS[peer]}: " + ", ".join(
                    f"batch {x['batch']} seq {x['seq']} ×{x[peer]['median_ms'] / x[ours_static]['median_ms']:.2f}"
                    for x in pair) + ".", ""]
    return "\n".join(lines)


def plot(r: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines = report_engines(r)
    ths = sorted({x["threads"] for x in r["results"]})
    fig, axes = plt.subplots(1, len(ths), figsize=(7 * len(ths), 4.4), squeeze=False)
    for ax, th in zip(axes[0], ths):
        rows = [x for x in r["results"] if x["threads"] == th]
        xs = np.arange(len(rows))
        w = 0.8 / len(engines)
        for i, k in enumerate(engines):
            ax.bar(xs + (i - (len(engines) - 1) / 2) * w, [x["speedup_vs_pytorch_fp32"][k] for x in rows], w,
                   label=LABELS[k])
        ax.set_xticks(xs, [f"b{x['batch']}\ns{x['seq']}" for x in rows])
        ax.axhline(1.0, color="k", lw=0.6)
        ax.set_title(f"{th} thread{'s' if th > 1 else ''}")
        ax.set_ylabel("speed-up vs PyTorch fp32 (median)")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"CPU latency, {r['machine']}, {r['date']}", fontsize=10)
    fig.tight_layout()
    atomic_savefig(fig, path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
