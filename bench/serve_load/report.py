"""The pages and plot of bench/serve_load's runs: the full load benchmark, the token-budget comparison and the
`docker run` comparison."""
from __future__ import annotations

import json

import numpy as np

from bench.lib.report import figure, table


def backend_desc(name: str) -> str:
    if name == "onnxruntime":
        return "ONNX Runtime CPU"
    try:
        import torch

        gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except ImportError:
        gpu = "no torch"
    return {"torch-cuda": "PyTorch CUDA 2:4 INT8", "tensorrt": "TensorRT", "torch": "PyTorch"}[name] + f" ({gpu})"


def _gpu_of(desc: str) -> str | None:
    """The GPU named in a backend description such as "PyTorch CUDA 2:4 INT8 (NVIDIA H100 80GB HBM3)"."""
    inner = desc[desc.rfind("(") + 1:-1] if desc.endswith(")") else ""
    return inner if inner and inner not in ("no GPU", "no torch") else None


LEVEL_HEADER = ("batching", "clients", "req/s", "p50 ms", "p95 ms", "p99 ms", "mean batch", "non-200")


def level_row(label: str, lv: dict) -> list:
    """One row of a level table: throughput, latency percentiles, mean batch and what was not a 200."""
    nan = float("nan")
    non200 = {k: v for k, v in lv["status_counts"].items() if k != "200"}
    tail = f", {lv['transport_errors']} transport errors" if lv["transport_errors"] else ""
    return [label, lv["clients"], f"{lv['throughput_rps']:.1f}", f"{lv.get('p50_ms', nan):.2f}",
            f"{lv.get('p95_ms', nan):.2f}", f"{lv.get('p99_ms', nan):.2f}", f"{lv.get('mean_batch', 1):.1f}",
            f"{non200 or '-'}{tail}"]


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _overhead_lines(res: dict) -> list[str]:
    s, b = res["summary"], res["bare_backend"]
    tput = b["throughput_seq_per_s"]
    return [
        f"- Bare backend at batch 1 (tokenize + {res.get('backend_desc', 'ONNX Runtime')}, no server, back to back): "
        f"p50 {b['p50_ms']:.2f} ms (inference alone {b['infer_p50_ms']:.2f} ms). Its own throughput: "
        f"{tput['batch1']:.0f} seq/s at batch 1, {tput['batch32_pad_longest']:.0f} at batch 32 padded to the longest, "
        f"{tput['batch32_grouped']:.0f} at batch 32 in length groups (what the server does): the most batching can "
        f"buy on this CPU is about {tput['batch32_grouped'] / tput['batch1']:.2f}x.",
        f"- Overhead at batch 1, batching off, 1 client, {res['batch1_http']['n']} requests alternating in chunks with "
        f"the bare backend: HTTP p50 {res['batch1_http']['p50_ms']:.2f} ms. End to end (HTTP p50 minus the bare p50; "
        f"includes the client, loopback TCP and the process/thread wake-ups of a shared CPU): "
        f"**{s['overhead_p50_ms']:.2f} ms** (≤ 1 ms: {_met(s['overhead_target_met'])}). "
        f"Per request, HTTP time minus the model time the server measured for that same request (everything but "
        f"the model call, client and TCP included; unlike the line before, not inflated by the model running "
        f"slower after the CPU idled between requests than back to back): "
        f"**{s['overhead_vs_own_inference_p50_ms']:.2f} ms** "
        f"(≤ 1 ms: {_met(s['overhead_vs_own_inference_p50_ms'] <= 1.0)}). "
        f"Inside the server (ASGI app time from the access log minus the request's inference time, p50; "
        f"body read, routing, validation, tokenization, queueing, softmax, JSON, logging, metrics; a lone request "
        f"runs on the event loop, see --inline-single): "
        f"**{s['in_server_overhead_p50_ms']:.2f} ms** (≤ 1 ms: {_met(s['in_server_overhead_target_met'])}). "
        f"For scale, a GET /healthz round trip through the same client and HTTP stack takes "
        f"{res['http_floor']['p50_ms']:.2f} ms at p50.",
    ]


def markdown(res: dict) -> str:
    """The full load benchmark's page."""
    m, s = res["machine"], res["summary"]
    gpu = _gpu_of(res.get("backend_desc", ""))
    lines = [
        f"# Serving load: {res['checkpoint']['name']} on " + (f"{gpu} + " if gpu else "")
        + f"{m['cores']}-core {m['arch']} CPU", "",
        f"{res['date']} · {m['cpu']} · {res.get('backend_desc', 'ONNX Runtime CPU')}, {res['threads']} intra-op "
        f"thread(s) · {res['texts']} · one text per request, closed-loop clients on loopback, "
        f"{res['duration_s']} s (max {res['max_requests']} requests) per level and mode, in "
        f"{res['rounds']} rounds that alternate batching off and on.",
        f"The cores are shared with other work: load average at start {m['load_avg_at_start'][0]:.2f} "
        f"(`{m['uptime_at_start']}`), so absolute numbers are noisy; ratios were measured in one run.", "",
        *table(LEVEL_HEADER, (level_row(mode, lv) for mode in ("off", "on") for lv in res["modes"][mode]["levels"])),
        "", *_overhead_lines(res),
        f"- Throughput at 32 clients, batching on vs off: **{s['speedup_32']:.2f}x** "
        f"(target ≥ 2x: {_met(s['speedup_target_met'])}).",
        f"- Overload ({res['overload']['clients']} clients, queue of {res['overload']['max_queue_size']} sequences): "
        f"{res['overload']['status_counts']}, {res['overload']['transport_errors']} transport errors "
        f"(target: only 200 and 503: {_met(s['overload_only_503'])}).",
        f"- Errors other than 503 across all levels: {s['non_503_errors']}.",
    ]
    return "\n".join(lines) + "\n"


def plot(res: dict, path) -> None:
    """Throughput and p50/p99 latency against clients, batching off and on."""
    with figure(path, figsize=(11, 4.2), ncols=2) as (fig, (ax1, ax2)):
        for mode, color in (("off", "tab:gray"), ("on", "tab:blue")):
            lv = res["modes"][mode]["levels"]
            x = [v["clients"] for v in lv]
            ax1.plot(x, [v["throughput_rps"] for v in lv], "o-", color=color, label=f"batching {mode}")
            for q, style in (("p50_ms", "-"), ("p99_ms", "--")):
                ax2.plot(x, [v.get(q, np.nan) for v in lv], style, marker="o", color=color,
                         label=f"{q[:3]} batching {mode}")
        for ax in (ax1, ax2):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("concurrent clients")
            ax.grid(alpha=0.3)
            ax.legend()
        ax1.set_ylabel("requests / s")
        ax2.set_ylabel("latency (ms)")
        ax2.set_yscale("log")
        m = res["machine"]
        fig.suptitle(f"holoserve serve, {res['checkpoint']['name']}, ONNX Runtime on {m['cores']}-core {m['arch']} "
                     f"CPU ({res['date']})", fontsize=10)


def tokens_markdown(res: dict) -> str:
    """The token-budget comparison's page."""
    m, L, st = res["machine"], res["lengths"], res["settings"]
    grouping = ("(the default: a batch is run in length groups)." if st["max_padding_waste"] >= 0 else
                "(no length groups: every batch is padded to its longest).")
    lines = [f"# Token-budget batching: {res['checkpoint']['name']} on a {m['cores']}-core "
             f"{m['arch'].replace('_', '-')} CPU", "",
             f"{res['date']} · {m['cpu']} · ONNX Runtime CPU, {res['threads']} intra-op thread(s) · {res['texts']}, "
             f"tokens per text: min {L['min']}, median {L['p50']:.0f}, mean {L['mean']}, p90 {L['p90']:.0f}, "
             f"max {L['max']} (truncated at {L['max_seq_length']}) · one text per request, closed-loop clients on "
             f"loopback, {res['duration_s']} s per mode and level in {res['rounds']} alternating rounds. "
             f"Every mode: --max-batch-size {st['batch_size']}, --max-queue-delay-ms {st['queue_delay_ms']}, "
             f"--max-padding-waste {st['max_padding_waste']} " + grouping,
             f"The cores are shared with other work (load average at start {m['load_avg_at_start'][0]:.2f}, "
             f"`{m['uptime_at_end']}` at the end): absolute numbers are noisy; the modes ran interleaved.", ""]
    rows = [level_row("count (32)" if mode == "count" else f"--max-batch-tokens {mode.split('_')[1]}", lv)
            for mode, v in res["modes"].items() for lv in v["levels"]]
    return "\n".join([*lines, *table(LEVEL_HEADER, rows)]) + "\n"


def legs_text(res: dict) -> str:
    """How the containers were started: in two legs, the second in the opposite order, where the run had them."""
    orders = res.get("start_orders") or []
    if len(orders) < 2:
        return ""
    return (", in two legs with fresh containers started " + " and then ".join(" before ".join(o) for o in orders))


def docker_markdown(res: dict) -> str:
    """The `docker run` default against the same image forced to ONNX Runtime (or given the runtimes' own
    thread count)."""
    m = res["machine"]
    rows = [[n, v["backend"], lv["clients"], lv["throughput_rps"], lv.get("p50_ms"), lv.get("p99_ms"),
             lv.get("server_cpu_ms_per_request", "—"), lv.get("client_cpu_ms_per_request", "—"),
             lv["status_counts"]] for n, v in res["variants"].items() for lv in v["levels"]]
    versus = res.get("versus", "onnxruntime")
    cpus = f" under `docker run --cpus {res['cpus']:g}`" if res.get("cpus") else ""
    cpus += ", AMX refused to both (`--deny-amx`)" if res.get("deny_amx") else ""
    lines = [f"# `docker run` defaults vs {versus}, same image{cpus} ({res['date']})", "",
             f"Machine: {m.get('cpu', '')}; image `{res['image']}`, {res['image_mb']} MB; checkpoint "
             f"{res['checkpoint']}; {res['texts']}; {res['rounds']} alternating rounds, {res['duration_s']} s per "
             f"level and variant{legs_text(res)}.", "",
             *table(("variant", "backend", "clients", "req/s", "p50 ms", "p99 ms", "server CPU ms/answer",
                     "client CPU ms/answer", "statuses"), rows),
             "", f"Load average at the start and end: {m['uptime_at_start'].split('load average: ')[-1]}; "
             f"{m['uptime_at_end'].split('load average: ')[-1]}.",
             "", f"Default's selection: {res['variants']['default']['selection']}", "",
             *(f"Threads, {n}: {v.get('threads')}" for n, v in res["variants"].items()), "",
             f"Summary: {json.dumps(res['summary'])}", ""]
    return "\n".join(lines)
