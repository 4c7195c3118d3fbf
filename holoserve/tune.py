"""`holoserve tune CKPT`: measure, once and long enough to be stable, which CPU backend serves a checkpoint
fastest on this machine, and write the decision into the checkpoint as its serving profile
(holoserve.backends.profile), which `holoserve serve --backend auto` then uses instead of timing at start-up.

It loads the CPU backends the checkpoint has exports for (ONNX Runtime; OpenVINO; OpenVINO again with a small
grid of static shapes) with the options the server gives them, and times them in turns, round by round, on
the checkpoint's dev texts (or --texts FILE) in the batches the server's batcher forms. The decision and the
rule it follows are profile.decide's and profile.keep_static's. Where `--openvino-kernels auto` turns the 2:4
kernels on, a first phase times OpenVINO with them against OpenVINO with its own GEMMs, and the kernels stay
only where they are faster by the margin (kernels_verdict): how much skipping the zeros pays depends on the
CPU's cores, not on its flags.
"""
from __future__ import annotations

import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from . import HoloServeError
from .backends import profile
from .backends.profile import STATIC, Texts

MAX_TEXTS = 4096  # texts tokenized from a file: far more than the rounds of a long run take
TEXT_COLUMNS = ("text", "sentence", "sentence1", "question")  # as `holoserve compress` looks for them
PAIR_COLUMNS = ("text_pair", "sentence2", "sentence")


@dataclass
class TuneOptions:
    texts: Path | None = None
    text_column: str | None = None
    text_pair_column: str | None = None
    duration: float = 60.0
    min_rounds: int = 5
    threads: int = 0
    workers: int = 1
    instances: str = "auto"
    max_batch_size: int = 32
    openvino_precision: str = "auto"
    openvino_kernels: str = "auto"
    openvino_sparse_weights: bool = False
    static_shapes: bool = True


# --------------------------------------------------------------------------- texts from a file


def read_texts(path: Path, pair: bool, text_column: str | None = None, pair_column: str | None = None) -> Texts:
    """Texts from a file: one text a line, or a CSV, TSV or JSON Lines file with a text column (and a second
    one for a checkpoint that reads text pairs). Raises HoloServeError naming the problem and the fix."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise HoloServeError(f"--texts {path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix in (".csv", ".tsv", ".tab"):
            with open(path, encoding="utf-8-sig", newline="") as f:
                rows = list(csv.DictReader(f, delimiter="," if suffix == ".csv" else "\t",
                                           quoting=csv.QUOTE_MINIMAL if suffix == ".csv" else csv.QUOTE_NONE))
            header = list(rows[0]) if rows else []
        elif suffix in (".jsonl", ".ndjson", ".json"):
            rows = _json_lines(path)
            header = list(rows[0]) if rows else []
        else:
            if pair:
                raise HoloServeError(f"--texts {path}: the checkpoint reads text pairs; give a CSV, TSV or JSON "
                                     "Lines file with two text columns (e.g. sentence1 and sentence2)")
            lines = [ln.strip() for ln in path.read_text(encoding="utf-8-sig").splitlines()]
            texts = [ln for ln in lines if ln][:MAX_TEXTS]
            if not texts:
                raise HoloServeError(f"--texts {path} holds no text: write one text a line")
            return Texts(texts, f"{path.name} (one text a line)")
    except UnicodeDecodeError as e:
        raise HoloServeError(f"--texts {path}: not UTF-8 text ({e.reason}); save the file as UTF-8") from None
    except csv.Error as e:
        raise HoloServeError(f"--texts {path} cannot be read as {suffix[1:].upper()} ({e})") from None
    if not rows:
        raise HoloServeError(f"--texts {path} holds no rows")
    text = _column(path, header, text_column, TEXT_COLUMNS, "--text-column")
    second = _column(path, header, pair_column, [c for c in PAIR_COLUMNS if c != text], "--text-pair-column"
                     ) if pair else None
    texts = [(str(r.get(text) or ""), str(r.get(second) or "")) if second else str(r.get(text) or "")
             for r in rows[:MAX_TEXTS]]
    texts = [t for t in texts if (t[0] if second else t)]
    if not texts:
        raise HoloServeError(f"--texts {path}: column {text!r} is empty in every row")
    return Texts(texts, f"{path.name}, column {text!r}" + (f" and {second!r}" if second else ""))


def _json_lines(path: Path) -> list[dict[str, Any]]:
    rows = []
    with open(path, encoding="utf-8-sig") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise HoloServeError(f"--texts {path}, line {i}: not JSON ({e}); write one JSON object a line")
            if not isinstance(row, dict):
                raise HoloServeError(f"--texts {path}, line {i}: not a JSON object; write one object a line, "
                                     'e.g. {"text": "a fine film"}')
            rows.append(row)
    return rows


def _column(path: Path, header: list[str], given: str | None, defaults, flag: str) -> str:
    if given is not None:
        if given not in header:
            raise HoloServeError(f"--texts {path}: no column {given!r}; its columns are "
                                 f"{', '.join(map(repr, header))}")
        return given
    found = next((c for c in defaults if c in header), None)
    if found is None:
        raise HoloServeError(f"--texts {path}: no text column among {', '.join(map(repr, header))}; name it with "
                             f"{flag} NAME (default: one of {', '.join(defaults)})")
    return found


def texts_for(artifact, opts: TuneOptions) -> Texts:
    """--texts FILE, else the checkpoint's dev texts; a clear error where there are neither."""
    if opts.texts is not None:
        return read_texts(opts.texts, artifact.is_pair, opts.text_column, opts.text_pair_column)
    found = profile.dev_texts(artifact)
    if found is None:
        raise HoloServeError(
            f"no dev texts known for {artifact.path} (task {artifact.task_name!r}: not GLUE SST-2, and no GLUE "
            "folder in $HOLOSERVE_DATA_DIR holds its dev split): pass --texts FILE with texts like the ones it "
            "will serve (one a line, or a CSV, TSV or JSON Lines file with a text column)")
    return found


# --------------------------------------------------------------------------- the run


def _load(artifact, options: dict[str, Any], opts: TuneOptions, items, out: TextIO
          ) -> tuple[dict, dict, dict | None]:
    """The backends to time, by name; the static grid (empty where OpenVINO is not timed with one); and the
    kernels' phase (_choose_kernels: None where it did not run)."""
    from .backends import BackendUnavailable, load_backend

    loaded: dict[str, Any] = {}
    kernels: dict[str, Any] | None = None
    for name in profile.CPU_BACKENDS:
        if artifact.export(name) is None:
            what = "holoserve export CKPT" + (" --target openvino" if name == "openvino" else "")
            print(f"{name}: not timed, the checkpoint has no {name} export ({what})", file=out)
            continue
        if name == "openvino":
            from .backends.openvino import INT8_SATURATES, int8_gemm_saturates

            if int8_gemm_saturates():
                print(f"openvino: not timed, {INT8_SATURATES}", file=out)
                continue
        try:
            if name == "openvino":
                options, kernels, loaded[name] = _choose_kernels(artifact, options, opts, items, out)
            else:
                loaded[name] = load_backend(name, artifact, **options)
        except (BackendUnavailable, ImportError) as e:
            print(f"{name}: not timed, it cannot load here: {e}", file=out)
    if not loaded:
        raise HoloServeError(f"no CPU backend can load {artifact.path}: export it first (`holoserve export "
                             f"{artifact.path}` writes the ONNX Runtime and OpenVINO exports)")
    grid: dict[int, list[tuple[int, int]]] = {}
    if "openvino" in loaded and opts.static_shapes:
        sizes = profile.batch_sizes(opts.max_batch_size)
        grid = profile.static_grid(items, sizes, artifact.max_seq_length, profile.pad_id(artifact))
        shapes = profile.grid_shapes(grid)
        spec = ",".join(f"{b}x{s}" for b, s in shapes)
        print(f"openvino: compiling {len(shapes)} static shapes to time against its dynamic model: {spec}", file=out)
        try:
            loaded[STATIC] = load_backend("openvino", artifact, **{**options, "openvino_shapes": spec})
        except HoloServeError as e:
            print(f"openvino: static shapes not timed, they do not compile here: {e}", file=out)
            grid = {}
    return loaded, grid, kernels


KERNELS_SHARE = 0.25  # the kernels' phase runs this share of --duration before the main timing
KERNELS, GEMMS = "2:4 kernels", "OpenVINO's GEMMs"


def _choose_kernels(artifact, options: dict[str, Any], opts: TuneOptions, items, out: TextIO
                    ) -> tuple[dict[str, Any], dict[str, Any] | None, Any]:
    """OpenVINO loaded as `options` say; where `--openvino-kernels auto` turned the 2:4 kernels on, first timed
    against OpenVINO with its own GEMMs (the same batches, in turns) and replaced by that where the kernels
    were not faster by the margin. Returns (the options the rest of tune loads OpenVINO with, the phase's
    record or None where it did not run, the OpenVINO backend kept)."""
    from .backends import load_backend

    with_kernels = load_backend("openvino", artifact, **options)
    if options.get("openvino_kernels") != "auto" or not _kernels_status(with_kernels).startswith("on"):
        return options, None, with_kernels
    gemms = {**options, "openvino_kernels": "off"}
    own = load_backend("openvino", artifact, **gemms)
    sizes = profile.batch_sizes(opts.max_batch_size)
    seconds = opts.duration * KERNELS_SHARE
    print(f"openvino: timing the 2:4 kernels against OpenVINO's own GEMMs for about {seconds:.0f} s (OpenVINO "
          f"runs on them only where they are {profile.MARGIN:.0%} faster)", file=out, flush=True)
    timings = profile.time_backends({KERNELS: with_kernels, GEMMS: own}, items, sizes,
                                    profile.Plan(min_rounds=opts.min_rounds, seconds=seconds),
                                    profile.pad_id(artifact))
    record = kernels_verdict(timings.medians(), sizes)
    record.update(rounds=timings.rounds, seconds=round(timings.seconds, 1))
    print(f"openvino: {record['reason']}", file=out, flush=True)
    if record["kept"]:
        return options, record, with_kernels
    return gemms, record, own


def kernels_verdict(medians: dict[str, dict[int, float]], sizes: list[int],
                    margin: float = profile.MARGIN) -> dict[str, Any]:
    """Whether the 2:4 kernels stay, from the medians of the kernels' phase: only where they took at most
    1 - margin of the time of OpenVINO's own GEMMs (geometric mean over batch sizes); on a tie OpenVINO's own
    GEMMs, the simpler path, are kept. The record the profile keeps (timings.kernels)."""
    ratio = profile.gmean_ratio(medians[KERNELS], medians[GEMMS], sizes)
    kept = ratio <= 1 - margin
    what = (f"the 2:4 kernels took {ratio:.2f}x the time of OpenVINO's own GEMMs (geometric mean over batch sizes "
            f"{sizes[0]} to {sizes[-1]}): ")
    # said of OpenVINO alone: the decision may still serve ONNX Runtime, which these timings do not touch
    what += ("OpenVINO runs on them" if kept else f"OpenVINO keeps its own GEMMs (it runs on the kernels only where "
                                                  f"they are {margin:.0%} faster)")
    return {"kept": kept, "ratio": round(ratio, 4), "reason": what,
            "median_ms": {("on" if n == KERNELS else "off"): {str(b): round(t, 4) for b, t in by.items()}
                          for n, by in medians.items()}}


PROGRESS_EVERY_S = 5.0  # one progress line per round at most this often (rounds of a small model are short)


def _progress(out: TextIO, duration: float):
    last = [-PROGRESS_EVERY_S]

    def show(r: int, timings: profile.Timings) -> None:
        if timings.seconds - last[0] < PROGRESS_EVERY_S:
            return
        last[0] = timings.seconds
        med = timings.medians()
        lo, hi = timings.sizes[0], timings.sizes[-1]
        parts = ", ".join(f"{n} {by[lo]:.2f}/{by[hi]:.2f}" for n, by in med.items())
        print(f"round {r} ({timings.seconds:.0f} of {duration:.0f} s): median ms at {lo}/{hi} rows: {parts}",
              file=out, flush=True)
    return show


def tune(checkpoint: str | Path, opts: TuneOptions, out: TextIO | None = None) -> tuple[dict[str, Any], Path]:
    """Time the checkpoint's CPU backends here and write its serving profile. Returns (profile, its path)."""
    from .core.artifact import load_artifact
    from .server.config import ServerConfig
    from .server.service import backend_options

    out = out if out is not None else sys.stderr
    try:
        artifact = load_artifact(checkpoint, verify=True)
    except OSError as e:
        raise HoloServeError(f"cannot read the checkpoint {checkpoint}: {e}") from None
    cfg = ServerConfig(artifact_dir=str(checkpoint), threads=opts.threads, workers=opts.workers,
                       instances=str(opts.instances), max_batch_size=opts.max_batch_size,
                       openvino_precision=opts.openvino_precision, openvino_kernels=opts.openvino_kernels,
                       openvino_sparse_weights=opts.openvino_sparse_weights).validate()
    options = backend_options(cfg, artifact)
    texts = texts_for(artifact, opts)
    items = profile.encode_texts(artifact, texts.rows)
    print(f"texts: {len(items)} from {texts.source}", file=out)
    loaded, grid, kernels_phase = _load(artifact, options, opts, items, out)
    sizes = profile.batch_sizes(opts.max_batch_size)
    print(f"timing {', '.join(loaded)} at batch sizes {', '.join(map(str, sizes))} for about {opts.duration:.0f} s "
          f"(at least {opts.min_rounds} rounds)", file=out, flush=True)
    plan = profile.Plan(min_rounds=opts.min_rounds, seconds=opts.duration, on_round=_progress(out, opts.duration))
    timings = profile.time_backends(loaded, items, sizes, plan, profile.pad_id(artifact))
    decision, medians, shapes, light = decide(timings, grid)
    if decision["backend"] == "routed":
        print(f"timing the routed pair as it serves ({profile.ROUTING_ROUNDS} rounds)", file=out, flush=True)
        as_served = {**loaded, "openvino": loaded[STATIC]} if shapes else loaded
        decision = profile.confirm_routing(as_served, decision, medians, items, sizes, profile.pad_id(artifact),
                                           light=light)
        decision["openvino_shapes"] = served_shapes(decision, shapes)
    kernels = _kernels_status(loaded.get("openvino"))
    if kernels:
        decision["openvino_kernels"] = "on" if kernels.startswith("on") else "off"
    if kernels_phase is not None:
        decision["reason"] += f"; {kernels_phase['reason']}"
        kernels = f"off: {kernels_phase['reason']}" if not kernels_phase["kept"] else kernels
    # the kernels' build is part of the key only where they serve: a server that follows a decision without
    # OpenVINO need not load it to check the key
    serves_kernels = decision.get("openvino_kernels") == "on" and "openvino" in profile.needed(decision)
    key = profile.machine_key(artifact, options, kernels_on=serves_kernels)
    extra = {"timings": {"static_grid": [f"{b}x{s}" for b, s in profile.grid_shapes(grid)],
                         **({"kernels": kernels_phase} if kernels_phase is not None else {})},
             "settings": {"max_batch_size": opts.max_batch_size, "duration_s": opts.duration,
                          "min_rounds": opts.min_rounds, "openvino_kernels_status": kernels}}
    prof = profile.new_profile(key, decision, timings, profile.texts_summary(texts, items), extra)
    return prof, profile.write_profile(artifact, prof)


def decide(timings: profile.Timings, grid: dict[int, list[tuple[int, int]]]
           ) -> tuple[dict[str, Any], dict, list[tuple[int, int]], dict[str, float]]:
    """The decision from tune's timings: OpenVINO's static shapes kept where they won by the margin, then
    profile.decide between ONNX Runtime and OpenVINO (with those shapes); the medians it decided on; all
    the (batch, seq) shapes kept (the decision lists those it serves: confirm_routing may change which); and light
    load's medians (one-row batches after the pause) it decided on."""
    medians = timings.medians()
    light = timings.light_medians()
    static = medians.pop(STATIC, None)
    static_light = light.pop(STATIC, None)
    kept: list[tuple[int, int]] = []
    won: list[int] = []
    if static is not None and "openvino" in medians:
        dynamic = medians["openvino"]
        kept, medians["openvino"] = profile.keep_static(dynamic, static, grid)
        won = [b for b in sorted(dynamic) if medians["openvino"][b] != dynamic[b]]  # where the static times replaced
        if profile.LIGHT in won and static_light is not None:  # one-row batches run on the static shapes
            light["openvino"] = static_light
    decision = profile.decide(medians, timings.tokens, light=light)
    decision["openvino_shapes"] = served_shapes(decision, kept)
    if static is not None and "openvino" in medians:
        decision["reason"] += (
            f"; OpenVINO with static shapes ({', '.join(f'{b}x{s}' for b, s in kept)}) beat its dynamic model by the "
            f"{profile.MARGIN:.0%} margin at batch size{'s' if len(won) > 1 else ''} {', '.join(map(str, won))}"
            if kept else
            f"; OpenVINO's static shapes did not beat its dynamic model by the {profile.MARGIN:.0%} margin at any "
            "batch size")
    return decision, medians, kept, light


def served_shapes(decision: dict[str, Any], shapes: list[tuple[int, int]]) -> list[str]:
    """The static shapes OpenVINO serves under `decision`, as "BATCHxSEQ": none where it does not serve, and
    none of the few rows the light-load route gives ONNX Runtime."""
    if "openvino" not in profile.needed(decision):
        return []
    rows = (decision.get("max_small_rows") or 0) if decision.get("small") != "openvino" else 0
    return [f"{b}x{s}" for b, s in shapes if b > rows]


def _kernels_status(backend) -> str:
    kernels = backend.info().get("kernels") if backend is not None else None
    return str(kernels.get("status", "")) if isinstance(kernels, dict) else ""


def report(prof: dict[str, Any], path: Path) -> str:
    """The timings as a table and the decision, for stdout."""
    t = prof["timings"]
    names = list(t["median_ms"])
    light = t.get("light_load") or {}
    lines = [f"median ms per batch over {t['rounds']} rounds ({t['seconds']:.0f} s):",
             "  ".join([f"{'rows':>5}", f"{'tokens':>7}", *(f"{n:>16}" for n in names)])]
    for b in t["batch_sizes"]:
        cells = [f"{t['median_ms'][n].get(str(b), float('nan')):16.3f}" for n in names]
        lines.append("  ".join([f"{b:>5}", f"{t['tokens_per_batch'].get(str(b), 0):7.0f}", *cells]))
    after = light.get("median_ms") or {}
    if after:
        cells = [f"{after[n]:16.3f}" if n in after else f"{'':16}" for n in names]
        lines.append("  ".join([f"{light['batch_size']:>5}", f"{'idle':>7}", *cells])
                     + f"   (each after a {light['pause_ms']:.0f} ms pause: light load)")
    d = prof["decision"]
    lines += [f"decision: {profile.describe(d)}", f"why: {d['reason']}", f"wrote {path}",
              "`holoserve serve` (--backend auto) uses it on this machine without timing at start-up"]
    return "\n".join(lines)
