"""The serving profile: which CPU backend serves a checkpoint on this machine, measured once by `holoserve tune`
and read by `serve --backend auto` instead of timing at start-up.

Both this measurement and `auto`'s start-up fallback time the CPU backends the same way: on the checkpoint's
own dev texts (or a given file), tokenized by its tokenizer, in batches of 1, 2, 4, ... rows up to the
server's largest batch, each padded to its longest row as the dynamic batcher pads it. The backends take
turns round by round on the same batches, so background load hits them alike, and each backend's time at
a batch size is the median over the rounds. A batch of one row is what a lightly loaded server runs: a
request that finds the runtime idle. Runtimes start such a batch slower than one that follows another
(their pool threads asleep, caches cold), and not all alike, so one-row batches are also timed each after
a pause (LIGHT_PAUSE_S). ONNX Runtime, the simpler backend, serves unless another is faster by MARGIN; two
backends are routed by batch size only where that gains MARGIN over the best single one, or where the
other backend serves one-row batches faster by MARGIN one way (after the pause, or back to back) and not
slower the other way (`decide`).

The profile (PROFILE_FILE in the checkpoint folder, JSON) holds the decision, the medians it came from,
what texts they were measured on, and a key: the CPU, the flags that change which kernels run, the
threads, the runtime versions, the backend options, the 2:4 kernels' build and the sha256 of the export
files. A profile whose key differs from this machine's is not used (`key_differences` says why), so a
re-export, a new runtime or another CPU means timing again. The manifest does not list the file: it
describes the machine, not the checkpoint, and `load_artifact` checks only the files the manifest lists.

Texts are read without the data extras (no `datasets`), so that the slim server image can run both.
"""
from __future__ import annotations

import csv
import hashlib
import importlib.util
import json
import math
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from holoserve import HoloServeError, __version__
from holoserve.core.artifact import Artifact
from holoserve.core.files import atomic_write_json
from holoserve.core.machine import cpu_flags, cpu_name
from holoserve.core.manifest import ONNXRUNTIME, OPENVINO
from holoserve.core.tokenizer import GROUP_WASTE, Encoded, TextEncoder, pad_batch, split_by_length

from .openvino import SEQ_MULTIPLE, amx_withheld
from .routed import RoutedCpuBackend

PROFILE_FILE = "serving-profile.json"
FORMAT = "holoserve-serving-profile"
VERSION = 2  # 2: one-row batches also timed after a pause, and the light-load route (max_small_rows)
MAX_PROFILE_BYTES = 1 << 20  # a profile is a few kB; a larger file is not one and is not read whole
CPU_BACKENDS = (ONNXRUNTIME, OPENVINO)  # ONNX Runtime first: the simpler backend, kept on a tie
SIMPLE = ONNXRUNTIME
STATIC = "openvino-static"  # the OpenVINO backend with a grid of static shapes, timed by `holoserve tune`
# Another backend (or a routed pair, or OpenVINO's static shapes) replaces the simpler choice only when it
# is this much faster: a smaller gain is within what repeated measurements on a busy machine move by.
MARGIN = 0.05
BATCH_SIZES = (1, 2, 4, 8, 16, 32)
TEXTS_PER_ROUND = 32  # texts each backend runs at each batch size per round (at least one batch)
LIGHT = 1  # the batch size of a lightly loaded server: one request at a time
# tune pauses this long before each one-row batch it times: requests 50 a second or fewer apart find the
# runtime idle (measured: docs/results/2026-11-29-light-load.md)
LIGHT_PAUSE_S = 0.02
LIGHT_PER_ROUND = 8  # one-row batches each backend runs per round, each after the pause
SHAPE_MULTIPLE = SEQ_MULTIPLE  # static shapes' sequence lengths are rounded up to it, as the dynamic model's


# --------------------------------------------------------------------------- texts


@dataclass
class Texts:
    """Texts (or text pairs) to time on, and where they came from."""

    rows: list[Any]
    source: str


def dev_texts(artifact: Artifact) -> Texts | None:
    """The checkpoint's dev texts, or None where it has none HoloServe can find: GLUE SST-2's dev set (which
    ships with HoloServe as the embedded sample's dev split) for an sst2 checkpoint, else the dev split of a
    GLUE task in $HOLOSERVE_DATA_DIR."""
    from holoserve.data import sample
    from holoserve.data.glue import DATA_DIR_ENV, task_file
    from holoserve.data.tasks import get_task

    try:
        task = get_task(artifact.task_name)
    except HoloServeError:
        return None  # not a GLUE task: only the user knows their texts
    if task.is_pair != artifact.is_pair:
        return None
    if task.name == sample.TASK:
        path, where = sample.file("dev"), "GLUE SST-2 dev set (the embedded sample's dev split)"
    elif os.environ.get(DATA_DIR_ENV):
        path = task_file(task, "dev", None)
        where = f"GLUE {task.folder} dev set (${DATA_DIR_ENV})"
    else:
        return None
    return Texts(read_glue_texts(path, task), f"{where}, {path.name}")


def read_glue_texts(path: Path, task: Any) -> list[Any]:
    """The text column(s) of a GLUE TSV (holoserve.data.tasks.GlueTask names them), quotes as literal text."""
    with open(path, encoding=task.encoding, newline="") as f:
        rows = list(csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE))
    if task.header and rows:
        header, rows = rows[0], rows[1:]
    else:
        header = [str(i) for i in range(max((len(r) for r in rows), default=0))]
    wanted = [task.text_column] + ([task.pair_column] if task.pair_column else [])
    missing = [c for c in wanted if c not in header]
    if missing:
        raise HoloServeError(f"{path}: no column {missing[0]!r} (the GLUE {task.folder} layout)")
    cols = [header.index(c) for c in wanted]
    out = [tuple(r[i] for i in cols) for r in rows if len(r) > max(cols)]
    return [r[0] for r in out] if len(cols) == 1 else out


def synthetic_items(artifact: Artifact, n: int = 256) -> list[Encoded]:
    """Random token ids at sentence-like lengths (a skewed spread up to the length that covers the training
    rows, from the manifest, else max_seq_length), for a checkpoint without dev texts."""
    seq = artifact.manifest.sequence_length
    top = min(artifact.max_seq_length, (seq.tokens_at_coverage if seq and seq.tokens_at_coverage else 0)
              or artifact.max_seq_length)
    try:
        vocab = int(json.loads((artifact.path / "config.json").read_text(encoding="utf-8")).get("vocab_size", 1000))
    except (OSError, ValueError, TypeError):
        vocab = 1000
    rng = np.random.default_rng(0)
    lengths = np.clip(np.rint(top * rng.beta(2.0, 3.0, n)), min(4, top), top).astype(int)
    low = min(1000, vocab // 2)
    return [Encoded(rng.integers(low, vocab, int(L)).astype(np.int64), np.zeros(int(L), np.int64), False)
            for L in lengths]


def encode_texts(artifact: Artifact, texts: Sequence[Any]) -> list[Encoded]:
    """Texts tokenized as the server tokenizes them (truncated to the checkpoint's max_seq_length)."""
    encoder = TextEncoder(artifact.path / "tokenizer.json", artifact.max_seq_length, pair=artifact.is_pair)
    return encoder.encode(list(texts))


def pad_id(artifact: Artifact) -> int:
    return TextEncoder(artifact.path / "tokenizer.json", artifact.max_seq_length).pad_id


def texts_summary(texts: Texts | None, items: Sequence[Encoded]) -> dict[str, Any]:
    """What the profile records of the texts: where from, how many, their sha256 and token lengths."""
    lengths = np.asarray([it.length for it in items])
    out: dict[str, Any] = {"source": texts.source if texts else "random token ids (no dev texts found)",
                           "rows": len(items)}
    if texts is not None:
        joined = "\n".join(r if isinstance(r, str) else "\t".join(r) for r in texts.rows)
        out["sha256"] = hashlib.sha256(joined.encode("utf-8")).hexdigest()
    out["tokens"] = {"p50": int(np.percentile(lengths, 50)), "p90": int(np.percentile(lengths, 90)),
                     "max": int(lengths.max())}
    return out


# --------------------------------------------------------------------------- timing


def batch_sizes(max_batch: int) -> list[int]:
    """BATCH_SIZES up to the server's largest batch, and that batch itself (powers of two beyond 32)."""
    max_batch = max(1, int(max_batch))
    sizes = {b for b in BATCH_SIZES if b <= max_batch} | {max_batch}
    b = BATCH_SIZES[-1]
    while b * 2 < max_batch:
        b *= 2
        sizes.add(b)
    return sorted(sizes)


def round_batches(items: Sequence[Encoded], size: int, round_index: int, pad: int = 0,
                  per_round: int = TEXTS_PER_ROUND, waste: float = GROUP_WASTE) -> list[list[tuple]]:
    """The batches of `size` rows one round runs, each as the server's batcher runs it: consecutive texts, each
    round taking the next ones (from the start again after the last), cut into length groups where padding
    them to their longest row would waste more than `waste` of the tokens (core.tokenizer.split_by_length),
    each group padded to its own longest row. Timing whole padded batches instead favours the backend whose
    larger batches are cheaper, which the server does not run."""
    count = max(1, per_round // size)
    start = round_index * count * size
    out = []
    for k in range(count):
        batch = [items[(start + k * size + i) % len(items)] for i in range(size)]
        out.append([pad_batch([batch[j] for j in g], pad) for g in split_by_length([e.length for e in batch], waste)])
    return out


@dataclass
class Plan:
    """How long to time: at least `min_rounds` rounds, then until `seconds` have passed or `max_rounds`."""

    min_rounds: int = 5
    max_rounds: int = 1000
    seconds: float = 60.0
    per_round: int = TEXTS_PER_ROUND
    light_per_round: int = LIGHT_PER_ROUND
    pause_s: float = LIGHT_PAUSE_S
    on_round: Callable[[int, "Timings"], None] | None = None


@dataclass
class Timings:
    """Milliseconds per batch for each backend at each batch size, one value per round."""

    sizes: list[int]
    ms: dict[str, dict[int, list[float]]]
    tokens: dict[int, float] = field(default_factory=dict)  # mean padded tokens (rows x longest) of a batch
    rounds: int = 0
    seconds: float = 0.0
    light: dict[str, list[float]] = field(default_factory=dict)  # ms of a one-row batch after the pause
    pause_s: float = LIGHT_PAUSE_S  # the pause before each of those batches (Plan.pause_s)

    def medians(self) -> dict[str, dict[int, float]]:
        return {n: {b: float(np.median(v)) for b, v in by.items() if v} for n, by in self.ms.items()}

    def light_medians(self) -> dict[str, float]:
        return {n: float(np.median(v)) for n, v in self.light.items() if v}


def run_light(run: Callable[..., Any], groups: Sequence[tuple], pause_s: float) -> float:
    """Seconds one batch of one row takes as a lightly loaded server runs it: after `pause_s` idle (none at 0)."""
    if pause_s > 0:
        time.sleep(pause_s)
    start = time.perf_counter()
    for feed in groups:
        run(*feed)
    return time.perf_counter() - start


def time_backends(backends: Mapping[str, Any], items: Sequence[Encoded], sizes: Sequence[int], plan: Plan,
                  pad: int = 0) -> Timings:
    """Time each backend on the same batches (run as the server runs them: round_batches), round by round: an
    untimed round first (first-run allocations, OpenVINO's first sight of a shape), then rounds in which the
    backends take turns at each batch size, in the reverse order every other round. Each turn starts with an
    untimed batch: the runtime that ran before leaves its pool threads spinning for a while (OpenVINO's cannot
    be told to stop), which would slow the first batch of the next one, as it never is in a server that runs
    one backend. Batches of LIGHT rows also run as light load meets them, each after plan.pause_s idle
    (Timings.light)."""
    if not items:
        raise HoloServeError("no texts to time the backends on")
    names = list(backends)
    timings = Timings(list(sizes), {n: {b: [] for b in sizes} for n in names}, pause_s=plan.pause_s)
    token_sums = {b: [0.0, 0] for b in sizes}
    t0 = time.perf_counter()
    r = 0
    while True:
        order = names if r % 2 else names[::-1]
        for b in sizes:
            batches = round_batches(items, b, r, pad, plan.per_round)
            light = round_batches(items, b, r, pad, plan.light_per_round) if b == LIGHT else []
            for name in order:
                run = backends[name].infer
                if light:  # first each after a pause, in which the other runtime's threads settle too
                    seconds = sum(run_light(run, groups, plan.pause_s) for groups in light)
                    if r:
                        timings.light.setdefault(name, []).append(seconds * 1000 / len(light))
                run(*batches[0][0])  # untimed: the other runtime's threads settle meanwhile
                start = time.perf_counter()
                for groups in batches:
                    for feed in groups:
                        run(*feed)
                if r:
                    timings.ms[name][b].append((time.perf_counter() - start) * 1000 / len(batches))
            if r:
                token_sums[b][0] += sum(feed[0].size for groups in batches for feed in groups)
                token_sums[b][1] += len(batches)
        if r:
            timings.rounds = r
            timings.seconds = time.perf_counter() - t0
            timings.tokens = {b: s / max(1, n) for b, (s, n) in token_sums.items()}
            if plan.on_round is not None:
                plan.on_round(r, timings)
            if r >= plan.min_rounds and (timings.seconds >= plan.seconds or r >= plan.max_rounds):
                return timings
        r += 1


# --------------------------------------------------------------------------- the decision


def _gmean(values: Sequence[float]) -> float:
    return float(math.exp(sum(math.log(max(v, 1e-12)) for v in values) / len(values)))


def gmean_ratio(a: Mapping[int, float], b: Mapping[int, float], sizes: Sequence[int]) -> float:
    """How long `a` takes against `b`: the geometric mean over batch sizes of their time ratios, so each
    batch size counts alike whatever its absolute time."""
    return _gmean([a[s] / b[s] for s in sizes])


def _slower_at_one_row(mine: tuple[float, float], theirs: tuple[float, float], margin: float) -> bool:
    """Whether one-row batches that take `mine` ms (after the pause, back to back) are slower than `theirs` by
    `margin` one way and not faster by it the other way."""
    slower = [t <= m * (1 - margin) for m, t in zip(mine, theirs)]
    faster = [m <= t * (1 - margin) for m, t in zip(mine, theirs)]
    return (slower[0] and not faster[1]) or (slower[1] and not faster[0])


def decide(medians: Mapping[str, Mapping[int, float]], tokens: Mapping[int, float], margin: float = MARGIN,
           route: bool = True, by_tokens: bool = True, light: Mapping[str, float] | None = None) -> dict[str, Any]:
    """The CPU backend(s) to serve from per-batch-size median times: ONNX Runtime unless the other is faster
    by `margin`; both, routed by batch size at the cut that gains most, where that gains `margin` over the
    single one (one-row batches never on a backend slow at them, below); or, where the other backend serves
    one-row batches faster than the single one by `margin` one way (after a pause, `light`: light load's
    ms; or back to back) and not slower by it the other way, those on the other and larger ones on the
    single one (the light-load route). Not routed with route=False; only the light-load route with by_tokens=False.
    `tokens` (mean padded tokens per batch at each size) places the token threshold. A routed decision is an
    estimate from each backend timed on its own: confirm_routing times the pair as it serves."""
    names = sorted(medians, key=lambda n: (n != SIMPLE, n))
    sizes = sorted(set.intersection(*(set(medians[n]) for n in names))) if names else []
    if not names or not sizes:
        raise HoloServeError("no timings to decide from")
    if len(names) == 1:
        return {"backend": names[0], "reason": f"{names[0]}, the only CPU backend timed"}
    simple, other = names[0], names[1]
    ratio = gmean_ratio(medians[other], medians[simple], sizes)
    if ratio <= 1 - margin:
        single, why = other, (f"{other} takes {ratio:.2f}x the time of {simple} (geometric mean over batch sizes "
                              f"{sizes[0]} to {sizes[-1]}): faster by more than the {margin:.0%} margin")
    else:
        verdict = (f"faster by less than the {margin:.0%} margin, so {simple}, the simpler backend, serves"
                   if ratio < 1 else f"{simple} is the faster")
        single, why = simple, (f"{other} takes {ratio:.2f}x the time of {simple} (geometric mean over batch sizes "
                               f"{sizes[0]} to {sizes[-1]}): {verdict}")
    if not route:
        return {"backend": single, "reason": why}
    # a backend slower at one-row batches than the other by the margin one way (after a pause, or back to
    # back: one client in a closed loop) and not faster by it the other way does not serve them
    slow_light = {n for n, m in ((simple, other), (other, simple))
                  if light and n in light and m in light and sizes[0] == LIGHT
                  and _slower_at_one_row((light[n], medians[n][LIGHT]), (light[m], medians[m][LIGHT]), margin)}
    best: tuple[float, int, str, str] | None = None
    for cut in range(1, len(sizes) if by_tokens else 1):
        for small, large in ((simple, other), (other, simple)):
            if small in slow_light:
                continue
            mixed = {s: medians[small if i < cut else large][s] for i, s in enumerate(sizes)}
            gain = 1 - gmean_ratio(mixed, medians[single], sizes)
            if best is None or gain > best[0] + 1e-12:
                best = (gain, cut, small, large)
    if best is not None and best[0] >= margin:
        gain, cut, small, large = best
        limit = int(math.sqrt(tokens[sizes[cut - 1]] * tokens[sizes[cut]]))
        return {"backend": "routed", "small": small, "large": large, "max_small_tokens": max(1, limit),
                "reason": (f"{small} up to {sizes[cut - 1]} rows and {large} from {sizes[cut]} rows takes "
                           f"{1 - gain:.2f}x the time of {single} alone: faster by more than the {margin:.0%} "
                           f"margin; {why}")}
    if single in slow_light:
        alt = other if single == simple else simple
        after, back = light[alt] / light[single], medians[alt][LIGHT] / medians[single][LIGHT]  # type: ignore[index]
        return {"backend": "routed", "small": alt, "large": single, "max_small_rows": LIGHT,
                "reason": (f"{why}; but one-row batches take {after:.2f}x the time on {alt} after a "
                           f"pause (light load) and {back:.2f}x back to back, so "
                           f"{alt} serves them (the light-load route)")}
    return {"backend": single, "reason": why}


ROUTING_ROUNDS = 12  # rounds of confirm_routing in `holoserve tune` (each runs every batch size once per side)


def confirm_routing(backends: Mapping[str, Any], decision: Mapping[str, Any],
                    medians: Mapping[str, Mapping[int, float]],
                    items: Sequence[Encoded], sizes: Sequence[int], pad: int = 0,
                    rounds: int = ROUTING_ROUNDS, light: Mapping[str, float] | None = None) -> dict[str, Any]:
    """`decision` where it is not routed, or where the routed pair, run as it serves, keeps what it was chosen
    for: faster than the single backend by the margin (routed by tokens), or, for the light-load route, not
    slower by the margin at the larger batches it leaves to the single backend; else the single backend's
    decision, saying why. Each backend timed on its own misses what two runtimes in one process cost each
    other when batches alternate between them (idle pool threads that spin, each runtime's weights pushed out
    of the caches by the other's): here the routed pair (as RoutedCpuBackend serves it) and the single backend
    take turns, round by round, each running one batch of every size in turn, so the pair switches runtimes
    as mixed load makes it. The light-load route's one-row batches are not timed here: under light load the
    pair runs them alone, as time_backends timed them, while taking turns would push each side's weights out
    of the caches for the other. `light` (light load's ms) is decide's, for the fallback."""
    if decision["backend"] != "routed":
        return dict(decision)
    single = decide(medians, {}, route=False)  # no route: no token threshold to place
    sides = {"routed": RoutedCpuBackend.from_route(backends, decision), "single": backends[single["backend"]]}
    light_route = decision.get("max_small_rows") is not None
    timed = [b for b in sizes if not (light_route and b <= decision["max_small_rows"])] or list(sizes)
    ms: dict[str, dict[int, list[float]]] = {n: {b: [] for b in timed} for n in sides}
    for r in range(rounds + 1):  # round 0 untimed: first runs of each shape
        for name in (sides if r % 2 else list(sides)[::-1]):
            run = sides[name].infer
            # an untimed batch first, as in time_backends: the other side's threads settle meanwhile
            run(*round_batches(items, sizes[0], r, pad, per_round=sizes[0])[0][0])
            for b in timed:
                groups = round_batches(items, b, r, pad, per_round=b)[0]
                start = time.perf_counter()
                for feed in groups:
                    run(*feed)
                if r:
                    ms[name][b].append((time.perf_counter() - start) * 1000)
    med = {n: {b: float(np.median(v)) for b, v in by.items()} for n, by in ms.items()}
    ratio = gmean_ratio(med["routed"], med["single"], timed)
    alone = f"the time of {single['backend']} alone"
    if light_route:
        measured = (f"run as served (every batch size in turn, switching runtimes), the pair took {ratio:.2f}x "
                    f"{alone} at batch sizes {timed[0]} to {timed[-1]}")
        if ratio <= 1 + MARGIN:
            return {**decision, "reason": f"{decision['reason']}; {measured}: kept"}
        return {**single, "reason": f"{single['reason']}; the light-load route was not kept: {measured}, slower "
                                    f"by more than the {MARGIN:.0%} margin"}
    measured = (f"run as served (every batch size in turn, switching runtimes), the routed pair took {ratio:.2f}x "
                f"{alone}")
    if ratio <= 1 - MARGIN:
        return {**decision, "reason": f"{decision['reason']}; {measured}: kept"}
    fallback = decide(medians, {}, by_tokens=False, light=light)  # the single backend, or its light-load route
    fallback["reason"] += f"; routing by tokens was not kept: {measured}, not faster by the {MARGIN:.0%} margin"
    return confirm_routing(backends, fallback, medians, items, sizes, pad, rounds, light)


GRID_PER_SIZE = 2  # static_grid: the shapes tried for each batch size


def static_grid(items: Sequence[Encoded], sizes: Sequence[int], max_seq: int, pad: int = 0, rounds: int = 8
                ) -> dict[int, list[tuple[int, int]]]:
    """Static shapes to try, for each batch size: the GRID_PER_SIZE (rows, length) shapes its batches' length
    groups (round_batches) run at most often, the length rounded up to SHAPE_MULTIPLE (at most max_seq).
    A batch the server forms runs on a static shape only where that adds little padding, so the shapes
    worth compiling are those the server's own executions have."""
    grid: dict[int, list[tuple[int, int]]] = {}
    for b in sizes:
        counts: dict[tuple[int, int], int] = {}
        for r in range(rounds):
            for groups in round_batches(items, b, r, pad):
                for feed in groups:
                    rows, seq = feed[0].shape
                    shape = (rows, max(1, min(int(math.ceil(seq / SHAPE_MULTIPLE) * SHAPE_MULTIPLE), max_seq)))
                    counts[shape] = counts.get(shape, 0) + 1
        grid[b] = sorted(sorted(counts, key=lambda x: (-counts[x], x))[:GRID_PER_SIZE])
    return grid


def grid_shapes(grid: Mapping[int, Sequence[tuple[int, int]]], sizes: Sequence[int] | None = None
                ) -> list[tuple[int, int]]:
    """The distinct shapes of a static grid (of the batch sizes `sizes`, all by default), smallest first."""
    return sorted({shape for b, shapes in grid.items() if sizes is None or b in sizes for shape in shapes})


def keep_static(dynamic: Mapping[int, float], static: Mapping[int, float],
                grid: Mapping[int, Sequence[tuple[int, int]]], margin: float = MARGIN
                ) -> tuple[list[tuple[int, int]], dict[int, float]]:
    """(the static shapes worth compiling, OpenVINO's times with them): the grid's shapes of each batch size
    at which the static models were faster by `margin`; the others would only cost memory and compile time."""
    faster = {b for b in dynamic if b in static and static[b] <= dynamic[b] * (1 - margin)}
    return grid_shapes(grid, faster), {b: (static[b] if b in faster else t) for b, t in dynamic.items()}


def describe(decision: Mapping[str, Any]) -> str:
    """The decision in a few words: "onnxruntime", "openvino with static shapes 1x32, 8x32", or the routing."""
    backend = decision["backend"]
    shapes = decision.get("openvino_shapes") or []
    with_shapes = f" (static shapes {', '.join(shapes)})" if shapes else ""
    if backend == "routed":
        s, l_ = decision["small"], decision["large"]
        small = ("one-row batches (light load)" if decision.get("max_small_rows") == LIGHT else
                 f"batches of up to {decision['max_small_rows']} rows" if decision.get("max_small_rows") else
                 f"batches of up to {decision['max_small_tokens']} tokens")
        return (f"{s}{with_shapes if s == OPENVINO else ''} for {small} and {l_}"
                f"{with_shapes if l_ == OPENVINO else ''} above")
    return backend + (with_shapes if backend == OPENVINO else "")


def needed(decision: Mapping[str, Any]) -> list[str]:
    """The backends a decision serves with."""
    if decision["backend"] == "routed":
        return [decision["small"], decision["large"]]
    return [decision["backend"]]


def medians_table(medians: Mapping[str, Mapping[int, float]]) -> str:
    """"1 rows: onnxruntime 1.2 ms, openvino 3.4 ms; 8 rows: ..." (fastest first at each size)."""
    sizes = sorted({b for by in medians.values() for b in by})
    return "; ".join(f"{b} rows: " + ", ".join(f"{n} {by[b]:.1f} ms" for n, by in
                                               sorted(medians.items(), key=lambda kv: kv[1].get(b, math.inf))
                                               if b in by) for b in sizes)


# --------------------------------------------------------------------------- the key


def _version(module: str) -> str | None:
    """The installed version of a runtime, without importing it where the package metadata says."""
    if importlib.util.find_spec(module) is None:
        return None
    from importlib import metadata

    for dist in metadata.packages_distributions().get(module, []):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def threads_setting(options: Mapping[str, Any]) -> int:
    """The intra-op threads the backends are given (0: the library's default), as their loaders read it."""
    return int(options.get("threads") or os.environ.get("HOLOSERVE_ORT_THREADS", "0") or 0)


def kernels_build() -> dict[str, str] | None:
    """The build key of the 2:4 kernels this machine would load (compiler left out, as a prebuilt library
    matches without one), or None where it cannot be computed."""
    try:
        from holoserve.kernels import build_key

        return build_key(None)
    except Exception:  # OpenVINO missing or broken: no kernels to key on
        return None


def machine_key(artifact: Artifact, options: Mapping[str, Any], kernels_on: bool = False) -> dict[str, Any]:
    """What the timings depend on besides the model's weights: the CPU, its flags that decide which kernels
    run (AVX-512, AMX, VNNI), the CPUs this process may use, the threads and the batches run at once (each
    instance's threads), the runtimes' versions, the backend
    options, the 2:4 kernels' build (when they run) and the sha256 of each CPU export file."""
    flags = sorted(f for f in cpu_flags() if f.startswith(("avx512", "amx")) or "vnni" in f)
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 0
    exports = {}
    for key in CPU_BACKENDS:
        entry = artifact.export(key)
        if entry is not None and entry.file in artifact.manifest.files:
            exports[key] = {"file": entry.file, "sha256": artifact.manifest.files[entry.file].sha256}
    return {
        "cpu_model": cpu_name(), "cpu_flags": flags, "cpus": cpus, "threads": threads_setting(options),
        "instances": int(options.get("instances") or 1),
        "onnxruntime": _version("onnxruntime"), "openvino": _version("openvino"),
        "openvino_options": {"precision": options.get("openvino_precision") or "auto",
                             "kernels": options.get("openvino_kernels") or "auto",
                             "sparse_weights": bool(options.get("openvino_sparse_weights"))},
        "kernels_build": kernels_build() if kernels_on else None,
        "amx_withheld": amx_withheld(),  # None (matching profiles from before it) where AMX runs or is absent
        "exports": exports,
    }


def key_differences(recorded: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """What differs between a profile's key and this machine's, one phrase each (empty: it matches)."""
    out = []
    for name in sorted(set(recorded) | set(current)):
        a, b = recorded.get(name), current.get(name)
        if a == b:
            continue
        if name == "exports":
            out.append("the export files differ from those timed (re-exported since, or another export added)")
        elif name == "kernels_build":
            out.append("the 2:4 kernels' build differs (another source, OpenVINO or C library)")
        else:
            out.append(f"{name}: {a!r} in the profile, {b!r} here")
    return out


# --------------------------------------------------------------------------- the file


def profile_path(artifact: Artifact | Path) -> Path:
    return Path(artifact.path if isinstance(artifact, Artifact) else artifact) / PROFILE_FILE


def new_profile(key: Mapping[str, Any], decision: Mapping[str, Any], timings: Timings,
                texts: Mapping[str, Any], extra: Mapping[str, Mapping[str, Any]] | None = None) -> dict[str, Any]:
    """The profile's JSON object; `extra` adds fields to its sections ({"timings": {...}, "settings": {...}})."""
    medians = timings.medians()
    out: dict[str, Any] = {
        "format": FORMAT, "version": VERSION, "holoserve_version": __version__,
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "decision": dict(decision),
        "key": dict(key),
        "timings": {"unit": "ms per batch, median over rounds", "margin": MARGIN,
                    "light_load": {"batch_size": LIGHT, "pause_ms": round(timings.pause_s * 1000, 3),
                                   "median_ms": {n: round(t, 4) for n, t in timings.light_medians().items()}},
                    "rounds": timings.rounds,
                    "seconds": round(timings.seconds, 1), "batch_sizes": list(timings.sizes),
                    "tokens_per_batch": {str(b): round(t, 1) for b, t in timings.tokens.items()},
                    "median_ms": {n: {str(b): round(t, 4) for b, t in by.items()} for n, by in medians.items()}},
        "texts": dict(texts),
        "settings": {},
    }
    for section, fields in (extra or {}).items():
        out[section].update(fields)
    return out


def write_profile(artifact: Artifact, profile: Mapping[str, Any]) -> Path:
    """Write the profile into the checkpoint folder atomically (a temporary file, fsynced, renamed)."""
    path = profile_path(artifact)
    try:
        atomic_write_json(path, dict(profile))
    except OSError as e:
        raise HoloServeError(f"cannot write {path} ({e.strerror or e}): the checkpoint folder must be writable "
                             "for `holoserve tune` (a container mounts it without :ro for this)") from None
    return path


def _check(profile: Any) -> str | None:
    """Why a parsed profile cannot be used as one, or None."""
    if not isinstance(profile, dict) or profile.get("format") != FORMAT:
        return f"it is not a {FORMAT} file"
    version = profile.get("version")
    if not isinstance(version, int) or version > VERSION:
        return f"its version {version!r} is not one this HoloServe reads ({VERSION})"
    if version < VERSION:
        return (f"it was written by an earlier HoloServe (version {version}), which timed one-row batches back to "
                "back instead of as light load meets them")
    decision, key = profile.get("decision"), profile.get("key")
    if not isinstance(decision, dict) or not isinstance(key, dict):
        return "it has no decision or no key"
    backend = decision.get("backend")
    if backend == "routed":
        limits = [decision.get(k) for k in ("max_small_tokens", "max_small_rows") if k in decision]
        if ({decision.get("small"), decision.get("large")} != set(CPU_BACKENDS) or len(limits) != 1
                or not isinstance(limits[0], int) or isinstance(limits[0], bool) or limits[0] < 1):
            return "its routed decision does not name both CPU backends and one positive token or row limit"
    elif backend not in CPU_BACKENDS:
        return f"its decision names no CPU backend ({backend!r})"
    shapes = decision.get("openvino_shapes", [])
    if not isinstance(shapes, list) or not all(isinstance(s, str) for s in shapes):
        return "its openvino_shapes is not a list of BATCHxSEQ strings"
    from .openvino import parse_shapes  # imports no OpenVINO

    try:
        parse_shapes(",".join(shapes))
    except HoloServeError as e:
        return str(e)
    if decision.get("openvino_kernels") not in (None, "on", "off"):
        return "its openvino_kernels is not on or off"
    return None


def read_profile(artifact: Artifact) -> tuple[dict[str, Any] | None, str | None]:
    """(the profile, None), (None, None) where there is none, or (None, why it cannot be used). Never raises
    for a damaged file: the server then times the backends as if there were none."""
    path = profile_path(artifact)
    if not path.exists() and not path.is_symlink():
        return None, None
    fix = f"run `holoserve tune {artifact.path}` to write it again"
    try:
        if path.is_symlink() or not path.is_file():
            return None, f"{path} is not a regular file; {fix}"
        if path.stat().st_size > MAX_PROFILE_BYTES:
            return None, f"{path} is larger than any serving profile; {fix}"
        profile = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError) as e:
        return None, f"{path} cannot be read ({e}); {fix}"
    except (ValueError, RecursionError) as e:
        return None, f"{path} is not valid JSON ({str(e)[:200]}); {fix}"
    problem = _check(profile)
    if problem:
        return None, f"{path} is not a serving profile this HoloServe can use: {problem}; {fix}"
    return profile, None
