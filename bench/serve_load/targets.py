"""The served CPU targets in one command: `docker run`'s defaults against the same image forced to ONNX Runtime
on short sentences, 64–128-token texts and text pairs (1 and 32 clients), and against an earlier image on
short sentences (32 clients); one table holds each ratio beside its target, with the machine named, and
targets.png draws them.

    python -m bench.serve_load.targets --image holoserve:cpu --baseline-image holoserve:b4e76ba \\
        --checkpoint runs/minilm-sst2 --pairs-checkpoint runs/minilm-mrpc --data-dir "$GLUE_DIR"

Before each kind of text's runs, as the README tells users, the image's `holoserve tune` writes the checkpoint's
serving profile on texts like those the runs send (skip it with --no-tune): the checkpoint's dev texts for
sentences and pairs; for 64–128-token texts, SST-2 train sentences joined to that length (`tune --texts`; the
runs send dev sentences joined). The table says which backend each default container served and why. Each
comparison is a `python -m bench.serve_load.run --docker` run (alternating rounds, both containers up), whose
own record lands beside the table. The targets are for a CPU with AVX-512 VNNI + VBMI and no AMX, where the
default serves OpenVINO on HoloServe's 2:4 kernels; the table says whether this CPU is one.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from datetime import datetime, timezone
from pathlib import Path

from bench import dated_results
from bench.lib.report import figure, machine, table, write_record
from bench.serve_load import run as serve_load
from bench.serve_load.modes import docker_options, run_docker
from holoserve.backends.profile import PROFILE_FILE

# (texts, versus, summary key, comparison, target): what each run is held to on a CPU with AVX-512 VNNI + VBMI
# and no AMX. Pairs carry no target of their own there (they are measured so that the two-segment path is
# seen), so their rows say "measured".
TARGETS = (
    ("long", "onnxruntime", "throughput_ratio_32", ">=", 1.3),
    ("long", "onnxruntime", "p50_ratio_1", "<=", 1.0),
    ("short", "onnxruntime", "throughput_ratio_32", ">=", 1.0),
    ("short", "onnxruntime", "p50_ratio_1", "<=", 1.0),
    ("pairs", "onnxruntime", "throughput_ratio_32", None, None),
    ("pairs", "onnxruntime", "p50_ratio_1", None, None),
    ("short", "baseline", "throughput_ratio_32", ">=", 1.3),
)
# On a CPU with AMX: never slower than ONNX Runtime, on every kind of text; an earlier image is measured only.
AMX_TARGETS = tuple((texts, versus, key, *((">=" if key.startswith("throughput") else "<=", 1.0)
                                          if versus == "onnxruntime" else (None, None)))
                    for texts, versus, key, *_ in TARGETS)
WHAT = {"throughput_ratio_32": "req/s at 32 clients", "p50_ratio_1": "p50 latency at 1 client"}
LONG_WORDS = 50  # tune_texts: words per joined training text, so most reach the 64 tokens of a quick checkpoint
TEXTS = {"short": "SST-2 dev sentences", "long": "three SST-2 dev sentences joined (64–128 tokens)",
         "pairs": "MRPC dev pairs"}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m bench.serve_load.targets", description=__doc__.splitlines()[0])
    ap.add_argument("--image", required=True, help="the image under test (docker build -f docker/Dockerfile)")
    ap.add_argument("--baseline-image", default=None,
                    help="an earlier image run with its own defaults, for the short-sentence comparison "
                         "(without it, that row says not measured)")
    ap.add_argument("--checkpoint", required=True, help="an exported single-text checkpoint (short and long texts)")
    ap.add_argument("--pairs-checkpoint", required=True, help="an exported text-pair checkpoint (e.g. MRPC)")
    ap.add_argument("--data-dir", default=os.environ.get("HOLOSERVE_DATA_DIR"),
                    help="GLUE folder (SST-2 and MRPC dev); default: built-in sentences, and no pairs run")
    ap.add_argument("--duration", type=float, default=20.0, help="seconds per level and container, over --rounds")
    ap.add_argument("--rounds", type=int, default=4, help="alternating rounds per level")
    ap.add_argument("--cpus", type=float, default=None, help="run every container under `docker run --cpus`")
    ap.add_argument("--deny-amx", action="store_true",
                    help="on a CPU with AMX, refuse it to every container (a seccomp rule): both runtimes then run "
                         "their AVX-512 VNNI kernels and the image serves the CPU as one without AMX, a stand-in "
                         "for the targets' CPU held to its targets")
    ap.add_argument("--no-tune", dest="tune", action="store_false",
                    help="do not run the image's `holoserve tune` on the checkpoints first")
    ap.add_argument("--tune-duration", type=float, default=60.0,
                    help="`holoserve tune --duration`: seconds it times each checkpoint for (default 60, its own)")
    ap.add_argument("--out", help="output folder (default bench/results/<today>-serve-targets)")
    return ap


def targets_here(deny_amx: bool = False) -> tuple:
    """The targets for the CPU the containers see: AMX_TARGETS where it has AMX (not denied), else TARGETS."""
    from holoserve.backends.openvino import cpu_has_amx

    return AMX_TARGETS if cpu_has_amx() and not deny_amx else TARGETS


def cpu_class(deny_amx: bool = False) -> str:
    """Whether the CPU the containers see is the one the targets name."""
    from holoserve.backends.openvino import cpu_has_amx
    from holoserve.kernels import cpu_missing

    missing = cpu_missing()
    if cpu_has_amx() and not deny_amx:
        return ("a CPU with AMX (the 2:4 kernels are left to OpenVINO's AMX GEMMs): held to never slower than "
                "ONNX Runtime")
    if missing:
        return f"a CPU without {', '.join(missing)}: not the targets' CPU (the 2:4 kernels cannot run)"
    if cpu_has_amx():
        return ("a CPU with AMX, refused to the containers (--deny-amx): a stand-in for the targets' CPU (AVX-512 "
                "VNNI + VBMI, no AMX), not that CPU")
    return "AVX-512 VNNI + VBMI, no AMX: the targets' CPU"


def tune_texts(kind: str, data_dir: str | None, folder: Path) -> Path | None:
    """What `holoserve tune` times before the runs of one kind of text: None (the checkpoint's dev texts) for
    sentences and pairs; for long texts, SST-2 train sentences (GLUE's, else the packaged sample's) joined in
    order until each has LONG_WORDS words, one a line in folder/tune-long.txt, so tune never sees a served text."""
    if kind != "long":
        return None
    from holoserve.data.glue import read_split

    out, group, words = [], [], 0
    for ex in read_split("sst2", "train", data_dir, limit=20000):
        group.append(ex.text.strip())
        words += len(group[-1].split())
        if words >= LONG_WORDS:
            out.append(" ".join(group))
            group, words = [], 0
    path = folder / "tune-long.txt"
    path.write_text("\n".join(out or [" ".join(group)]) + "\n", encoding="utf-8")
    return path


def tune(image: str, ckpt: Path, options: list[str], data_dir: str | None, texts: Path | None = None,
         duration: float = 60.0) -> str:
    """The image's `holoserve tune` on `ckpt` (mounted read-write, run as its owner, with the `docker run`
    options the servers get, whose CPU quota sets the threads a profile is written for; the GLUE folder, for
    its dev texts, and `texts` where given, mounted read-only): the decision it wrote."""
    st = ckpt.stat()
    extra, more = list(options), ["--duration", f"{duration:g}"]
    if data_dir:
        extra += ["-v", f"{Path(data_dir).resolve()}:/data:ro", "-e", "HOLOSERVE_DATA_DIR=/data"]
    if texts:
        extra += ["-v", f"{texts.resolve()}:/texts.txt:ro"]
        more += ["--texts", "/texts.txt"]
    try:
        out = run_docker("run", "--rm", *extra, "-v", f"{ckpt.resolve()}:/model", "--user", f"{st.st_uid}:{st.st_gid}",
                         "--entrypoint", "holoserve", image, "tune", "/model", *more, timeout=1800)
    except RuntimeError as e:
        raise SystemExit(f"holoserve tune in {image} failed on {ckpt}: {e}") from None
    lines = out.splitlines()
    return next((line for line in lines if line.startswith("decision: ")), lines[-1] if lines else "")


def kernels_phase(ckpt: Path) -> dict | None:
    """What the profile tune just wrote says of the 2:4 kernels against OpenVINO's own GEMMs (timings.kernels:
    the ratio, whether they serve, the medians), or None where tune did not time them."""
    try:
        found = json.loads((ckpt / PROFILE_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return (found.get("timings") or {}).get("kernels")


def runs(args, targets: tuple) -> list[tuple[str, str]]:
    """(texts, versus) of each comparison, each once; pairs only with GLUE data (MRPC has no built-in rows)."""
    out = []
    for texts, versus, *_ in targets:
        if (texts, versus) not in out and (texts != "pairs" or args.data_dir) \
                and (versus != "baseline" or args.baseline_image):
            out.append((texts, versus))
    return out


def run_name(texts: str, versus: str) -> str:
    """The stem of one comparison's record (NAME_docker.{json,md} in the output folder)."""
    return f"{texts}-vs-{versus}"


def measure(args, out_dir: Path, texts: str, versus: str) -> dict:
    """One `bench.serve_load.run --docker` comparison; its record."""
    name = run_name(texts, versus)
    other = f"image:{args.baseline_image}" if versus == "baseline" else versus
    ckpt = args.pairs_checkpoint if texts == "pairs" else args.checkpoint
    argv = ["--checkpoint", str(ckpt), "--docker", args.image, "--versus", other, "--texts", texts,
            "--clients", "32" if versus == "baseline" else "1,32", "--duration", str(args.duration),
            "--rounds", str(args.rounds), "--out", str(out_dir), "--name", name,
            # the duration ends each level, not run's cap on answers (reached from 500 req/s at 40 s)
            "--max-requests", str(int(args.duration * 5000))]
    if args.data_dir:
        argv += ["--data-dir", str(args.data_dir)]
    if args.cpus:
        argv += ["--cpus", f"{args.cpus:g}"]
    if args.deny_amx:
        argv += ["--deny-amx"]
    print(f"== {texts} texts, `docker run` defaults vs {other}", flush=True)
    serve_load.main(argv)
    return json.loads((out_dir / f"{name}_docker.json").read_text(encoding="utf-8"))


# where the default serves ONNX Runtime itself, both containers run the same backend: the ratio measures the
# noise between two identical servers, not a difference the target asks about
SAME = "same backend as the other (the ratio is noise)"
# at one client every batch has one row: where the default's light-load route gives those to ONNX Runtime, both
# containers run ONNX Runtime there, the default through its routed pair
SAME_ONE_ROW = "one-row batches on ONNX Runtime on both sides (the ratio is the routed pair's cost and noise)"


def one_row_on_onnxruntime(variant: dict) -> bool:
    """Whether a container's routed pair (its /v1/models routing) runs one-row batches on ONNX Runtime."""
    routing = variant.get("routing") or {}
    rows = routing.get("max_small_rows")
    return routing.get("small") == "onnxruntime" and isinstance(rows, int) and rows >= 1


def one_row_alike(record: dict, versus: str) -> bool:
    """Whether, against the image forced to ONNX Runtime, one client's one-row batches run alike on both sides:
    the default's routed pair gives them to ONNX Runtime, and both run as many batches at once (so as many threads
    each)."""
    default, other = record["variants"]["default"], record["variants"].get(versus, {})
    return (versus == "onnxruntime" and one_row_on_onnxruntime(default)
            and default.get("instances") == other.get("instances"))


def verdict(value: float | None, op: str | None, target: float | None) -> str:
    if value is None:
        return "not measured"
    if op is None:
        return "measured"
    return "met" if (value >= target if op == ">=" else value <= target) else "not met"


def rows(records: dict[tuple[str, str], dict], targets: tuple) -> list[dict]:
    """One row per target: the measured ratio, the target and whether it is met, with what the default served."""
    out = []
    for texts, versus, key, op, target in targets:
        rec = records.get((texts, versus))
        value = rec["summary"].get(key) if rec else None
        default = rec["variants"]["default"] if rec else {}
        same = versus == "onnxruntime" and default.get("backend") == "onnxruntime"
        one_row = key == "p50_ratio_1" and rec is not None and one_row_alike(rec, versus)
        measured = verdict(value, op, target)
        if value is not None and (same or one_row):
            measured = SAME if same else SAME_ONE_ROW
        out.append({"texts": texts, "versus": versus, "what": WHAT[key], "ratio": value,
                    "target": f"{op} {target}" if op else "—", "target_value": target, "verdict": measured,
                    "default_backend": default.get("backend"), "kernels": default.get("kernels")})
    return out


SHORT_TEXTS = {"short": "sentences", "long": "64-token texts", "pairs": "pairs"}


def plot(res: dict, path: Path) -> None:
    """One bar per row: the default's ratio to the other container, each target a tick on its bar; green where
    met, red where not, grey where nothing is held to it (a same-backend row, or one without a target)."""
    rows_ = [r for r in res["rows"] if r["ratio"] is not None]
    with figure(path, figsize=(9, 0.5 * len(rows_) + 1.6)) as (fig, ax):
        for i, r in enumerate(rows_):
            color = {"met": "tab:green", "not met": "tab:red"}.get(r["verdict"], "tab:gray")
            ax.barh(i, r["ratio"], color=color, alpha=0.8)
            ax.text(r["ratio"], i, f" {r['ratio']:.3f}", va="center", fontsize=8)
            if r["target_value"] is not None:
                ax.plot([r["target_value"]] * 2, [i - 0.4, i + 0.4], color="black", lw=2)
        ax.set_yticks(range(len(rows_)), [
            f"{SHORT_TEXTS[r['texts']]}: {r['what']}" + ("" if r["versus"] == "onnxruntime" else
                                                         f" vs {res['baseline_image']}") for r in rows_])
        ax.invert_yaxis()
        ax.axvline(1.0, color="gray", lw=0.8, ls="--")
        ax.set_xlim(0, 1.15 * max([1.0, *(r["ratio"] for r in rows_)]))
        ax.set_xlabel("default / other (req/s: higher is better, p50: lower); black tick: the target")
        ax.grid(axis="x", alpha=0.3)
        m = res["machine"]
        fig.suptitle(f"docker run defaults, {res['image']}, {m.get('cores', '')}-core CPU"
                     f"{' (AMX refused)' if res.get('deny_amx') else ''}, {res['date']}", fontsize=9)


def markdown(res: dict) -> str:
    m = res["machine"]
    lines = [f"# Served CPU targets: `docker run` defaults ({res['date']})", "",
             f"Machine: {m.get('cpu', '')}, {m.get('cores', '')} cores: {res['cpu_class']}. Image `{res['image']}`; "
             f"baseline `{res['baseline_image'] or 'none'}`; checkpoints {res['checkpoint']} and "
             f"{res['pairs_checkpoint']}; "
             f"{res['rounds']} alternating rounds, {res['duration_s']} s per level and container"
             + (" in two legs, the second with fresh containers started in the opposite order"
                if res["rounds"] >= 2 else "")
             + (f"; every container under `--cpus {res['cpus']:g}`" if res.get("cpus") else "")
             + ("; AMX refused to every container (`--deny-amx`)" if res.get("deny_amx") else "") + ".", "",
             f"`{res['command']}`", "", "![each ratio against its target](targets.png)", "",
             *table(("texts", "against", "ratio of", "default / other", "target", "", "default served", "2:4 kernels"),
                    ([TEXTS[r["texts"]], "the image forced to ONNX Runtime" if r["versus"] == "onnxruntime"
                      else res["baseline_image"], r["what"], r["ratio"], r["target"], r["verdict"],
                      r["default_backend"], r["kernels"] or "—"] for r in res["rows"])), ""]
    if res.get("tuned"):
        lines += ["`holoserve tune` in the image, before the runs of each kind of text:", "",
                  *(f"- {TEXTS[k]}: {t['checkpoint']} on {t['texts']}: {t['decision']}"
                    + (f"; {t['kernels']['reason']}" if t.get("kernels") else "")
                    for k, t in res["tuned"].items()), ""]
    lines += ["Each comparison's own record (every level, p99, the default's selection) is beside this page: "
              + ", ".join(f"`{n}_docker.md`" for n in res["runs"]) + ".", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag, path in (("--checkpoint", args.checkpoint), ("--pairs-checkpoint", args.pairs_checkpoint)):
        if not (Path(path) / "manifest.json").is_file():
            raise SystemExit(f"{flag} {path}: not a HoloServe checkpoint (no manifest.json)")
    out_dir = Path(args.out) if args.out else dated_results("serve_targets")
    out_dir.mkdir(parents=True, exist_ok=True)
    res: dict = {"benchmark": "serve_targets", "date": f"{datetime.now(timezone.utc):%Y-%m-%d %H:%M UTC}",
                 "machine": machine(), "cpu_class": cpu_class(args.deny_amx), "image": args.image,
                 "baseline_image": args.baseline_image, "checkpoint": Path(args.checkpoint).name,
                 "pairs_checkpoint": Path(args.pairs_checkpoint).name, "duration_s": args.duration,
                 "rounds": args.rounds, "cpus": args.cpus, "deny_amx": args.deny_amx,
                 "command": "python -m bench.serve_load.targets " + " ".join(sys.argv[1:] if argv is None else argv)}
    records, res["runs"], res["tuned"], targets = {}, [], {}, targets_here(args.deny_amx)
    plan = runs(args, targets)
    for kind in dict.fromkeys(texts for texts, _ in plan):  # each kind's runs after tune on texts like theirs
        if args.tune:
            ckpt = Path(args.pairs_checkpoint if kind == "pairs" else args.checkpoint)
            texts = tune_texts(kind, args.data_dir, out_dir)
            decision = tune(args.image, ckpt, docker_options(args.cpus, args.deny_amx, out_dir), args.data_dir,
                            texts, args.tune_duration)
            res["tuned"][kind] = {"checkpoint": ckpt.name, "texts": "SST-2 train sentences joined (tune --texts)"
                                  if texts else "its dev texts", "decision": decision,
                                  "kernels": kernels_phase(ckpt)}
        for texts, versus in plan:
            if texts == kind:
                records[(texts, versus)] = measure(args, out_dir, texts, versus)
                res["runs"].append(run_name(texts, versus))
    res["rows"] = rows(records, targets)
    plot(res, out_dir / "targets.png")
    _, md = write_record(res, out_dir, "targets", markdown)
    print(md.read_text(encoding="utf-8"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
