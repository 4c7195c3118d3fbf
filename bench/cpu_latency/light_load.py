"""What one request costs each CPU backend when it finds the runtime idle, as a lightly loaded server runs it:
one-row batches of the checkpoint's dev texts, each after a pause (0 ms: back to back), each backend running
its batches in a row (as a server that runs it alone), the backends taking turns round by round in
alternating order. `holoserve tune` times one-row batches after holoserve.backends.profile.LIGHT_PAUSE_S.

    python -m bench.cpu_latency.light_load runs/minilm-mrpc [--pauses 0,2,5,10,20,50] [--rounds 4] [--texts FILE]

Backends: ONNX Runtime; OpenVINO (dynamic model); OpenVINO with the serving profile's static shapes, where it
has any; OpenVINO on HoloServe's 2:4 kernels, forced on, where this CPU runs them (AVX-512 VNNI + VBMI).

Then moderate load, where the light-load route switches runtimes between batches: a one-row batch, then a
four-row one, back to back, again and again, on ONNX Runtime alone, on OpenVINO alone (static shapes where
the profile has them) and on the light-load route (one-row batches on ONNX Runtime, the rest on OpenVINO).
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from bench.cpu_latency.common import output_options, parse, save
from bench.lib.report import figure, machine, table
from holoserve import HoloServeError
from holoserve.backends import load_backend, profile
from holoserve.backends.base import BackendUnavailable
from holoserve.backends.routed import RoutedCpuBackend
from holoserve.core.artifact import load_artifact
from holoserve.core.machine import describe_cpu


def backends(art) -> tuple[dict, dict]:
    """(the backends timed, by label; why any was left out)."""
    out, left = {"onnxruntime": load_backend("onnxruntime", art), "openvino": load_backend("openvino", art)}, {}
    prof, _ = profile.read_profile(art)
    shapes = ",".join((prof or {}).get("decision", {}).get("openvino_shapes") or [])
    if shapes:
        out["openvino static"] = load_backend("openvino", art, openvino_shapes=shapes)
    else:
        left["openvino static"] = "the checkpoint's serving profile lists no static shapes"
    try:
        out["openvino 2:4 kernels"] = load_backend("openvino", art, openvino_kernels="on")
    except (BackendUnavailable, HoloServeError) as e:
        left["openvino 2:4 kernels"] = str(e)
    return out, left


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.cpu_latency.light_load", description=__doc__.splitlines()[0])
    ap.add_argument("checkpoint")
    ap.add_argument("--pauses", default="0,2,5,10,20,50", help="ms idle before each one-row batch, comma-separated")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--per-round", type=int, default=16, help="one-row batches per backend, pause and round")
    ap.add_argument("--texts", help="a texts file as `holoserve tune --texts` reads it (default: the dev texts)")
    output_options(ap, "light-load")
    args = parse(ap, argv)
    pauses = [float(p) for p in args.pauses.split(",")]
    art = load_artifact(args.checkpoint)
    if args.texts:
        from holoserve.tune import read_texts

        texts = read_texts(Path(args.texts), art.is_pair)
    else:
        texts = profile.dev_texts(art)
        if texts is None:
            raise SystemExit(f"{args.checkpoint} has no dev texts HoloServe can find: give --texts FILE "
                             "(or $HOLOSERVE_DATA_DIR for a GLUE task)")
    items = profile.encode_texts(art, texts.rows)
    pad = profile.pad_id(art)
    timed, left = backends(art)
    names = list(timed)
    ms: dict[float, dict[str, list[float]]] = {p: {n: [] for n in names} for p in pauses}
    print(f"{describe_cpu()}; one-row batches of {texts.source}; backends {', '.join(names)}", flush=True)
    for r in range(args.rounds + 1):  # round 0 untimed: first runs of each shape
        for p in pauses:
            batches = profile.round_batches(items, 1, r * len(pauses) + pauses.index(p), pad, args.per_round)
            for name in (names if r % 2 else names[::-1]):
                run = timed[name].infer
                for groups in batches:
                    seconds = profile.run_light(run, groups, p / 1000)
                    if r:
                        ms[p][name].append(seconds * 1000)
        if r:
            print(f"round {r}: " + "; ".join(
                f"{p:g} ms: " + ", ".join(f"{n} {np.median(ms[p][n]):.2f}" for n in names) for p in pauses),
                flush=True)
    med = {p: {n: float(np.median(v)) for n, v in by.items()} for p, by in ms.items()}
    mixed = moderate_load(timed, items, pad, args.rounds, args.per_round)
    report = {"machine": machine(), "checkpoint": str(args.checkpoint), "texts": texts.source,
              "rounds": args.rounds, "per_round": args.per_round, "left_out": left,
              "median_ms": {f"{p:g}": by for p, by in med.items()}, "moderate_load_ms": mixed,
              "vs_onnxruntime": {f"{p:g}": {n: round(t / by["onnxruntime"], 3) for n, t in by.items()}
                                 for p, by in med.items()}}
    save(report, args, markdown)
    with figure(args.out / f"{args.name}.png", figsize=(7, 4)) as (_, ax):
        for n in names[1:]:
            ax.plot(pauses, [med[p][n] / med[p]["onnxruntime"] for p in pauses], marker="o", label=n)
        ax.axhline(1.0, color="grey", lw=0.8, ls="--")
        ax.set_xlabel("idle before each one-row batch (ms)")
        ax.set_ylabel("time / ONNX Runtime's")
        ax.set_title(f"one request on an idle runtime ({report['machine']['cpu']})", fontsize=9)
        ax.legend()
    print("\n".join(markdown(report).splitlines()[-len(pauses) - 11:]))


def moderate_load(timed: dict, items, pad: int, rounds: int, pairs: int) -> dict[str, dict[str, float]]:
    """Median ms of the one-row and the four-row batches when they alternate back to back, on ONNX Runtime,
    on OpenVINO (static shapes where timed) and on the light-load route between the two."""
    ov = timed.get("openvino static", timed["openvino"])
    sides = {"onnxruntime": timed["onnxruntime"], "openvino": ov,
             "light-load route": RoutedCpuBackend(timed["onnxruntime"], ov, max_small_rows=1)}
    ms: dict[str, dict[str, list[float]]] = {n: {"1 row": [], "4 rows": []} for n in sides}
    for r in range(rounds + 1):
        ones = profile.round_batches(items, 1, r, pad, pairs)
        fours = profile.round_batches(items, 4, r, pad, 4 * pairs)
        for name in (list(sides) if r % 2 else list(sides)[::-1]):
            for one, four in zip(ones, fours):
                for label, groups in (("1 row", one), ("4 rows", four)):
                    seconds = profile.run_light(sides[name].infer, groups, 0.0)
                    if r:
                        ms[name][label].append(seconds * 1000)
    return {n: {k: round(float(np.median(v)), 3) for k, v in by.items()} for n, by in ms.items()}


def markdown(report: dict) -> str:
    names = list(next(iter(report["median_ms"].values())))
    rows = [[p, *(f"{by[n]:.2f} ({report['vs_onnxruntime'][p][n]:.2f}x)" for n in names)]
            for p, by in report["median_ms"].items()]
    left = "".join(f"\n- {n} not timed: {why}" for n, why in report["left_out"].items())
    return (f"# One-row batches after a pause\n\n{report['machine']['cpu']}, {report['machine']['cores']} cores; "
            f"{report['checkpoint']}, {report['texts']}; {report['rounds']} rounds of {report['per_round']} "
            f"batches per backend and pause; median ms (× ONNX Runtime's).{left}\n\n"
            + "\n".join(table(["pause ms", *names], rows)) + "\n\nModerate load: a one-row batch then a "
            "four-row one, back to back, again and again; median ms.\n\n"
            + "\n".join(table(["served by", "1-row batch", "4-row batch"],
                               [[n, f"{by['1 row']:.2f}", f"{by['4 rows']:.2f}"]
                                for n, by in report["moderate_load_ms"].items()])) + "\n")


if __name__ == "__main__":
    main()
