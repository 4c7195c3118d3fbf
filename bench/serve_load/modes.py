"""The two other comparisons of `python -m bench.serve_load.run`: count-based batching against token budgets
(--token-budgets), and a `docker run` of the image with its defaults against the same image forced to ONNX
Runtime (--docker)."""
from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.request
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from bench.lib.report import machine, uptime_text, write_record
from bench.serve_load.load import alternate_rounds, fleet, level_summary, take_turns, warm
from bench.serve_load.report import docker_markdown, tokens_markdown
from holoserve.core.artifact import load_artifact


def _now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")


def token_lengths(ckpt: Path, texts: list[str]) -> dict:
    from holoserve.core.tokenizer import TextEncoder

    art = load_artifact(ckpt)
    lens = np.asarray([e.length for e in TextEncoder(ckpt / "tokenizer.json", art.max_seq_length).encode(texts)])
    return {"n": int(len(lens)), "min": int(lens.min()), "p50": float(np.median(lens)),
            "mean": round(float(lens.mean()), 1), "p90": float(np.percentile(lens, 90)), "max": int(lens.max()),
            "max_seq_length": art.max_seq_length}


def token_budget_main(args, ckpt: Path, texts: list[str], text_source: str, out_dir: Path) -> int:
    """Count-based batching against token-budget batching, same server otherwise, modes alternating."""
    budgets = [int(x) for x in args.token_budgets.split(",")]
    levels = [int(x) for x in args.clients.split(",")] if args.clients != "1,8,32,128" else [32]
    base = ["--max-batch-size", str(args.batch_size), "--max-queue-delay-ms", str(args.queue_delay_ms),
            "--max-padding-waste", str(args.max_padding_waste), "--max-queue-size", "512", "--no-access-log"]
    modes = {"count": base, **{f"tokens_{b}": [*base, "--max-batch-tokens", str(b)] for b in budgets}}
    res: dict = {"benchmark": "serve_load_tokens", "date": _now(), "machine": machine(),
                 "checkpoint": {"name": ckpt.name, "max_seq_length": load_artifact(ckpt).max_seq_length},
                 "texts": text_source, "lengths": token_lengths(ckpt, texts), "threads": args.threads,
                 "duration_s": args.duration, "rounds": args.rounds, "max_requests": args.max_requests,
                 "settings": {k: getattr(args, k) for k in ("batch_size", "queue_delay_ms", "max_padding_waste")},
                 "client": "asyncio HTTP/1.1 keep-alive, one process, closed loop, one text per request",
                 "modes": {m: {"server_args": a, "levels": []} for m, a in modes.items()}}
    plans = {m: {"checkpoint": ckpt, "args": a, "backend": args.backend} for m, a in modes.items()}
    with fleet(plans, out_dir, f"{args.name}_tokens", args.threads) as servers:
        for srv in servers.values():
            warm(srv.port, texts)
        for c in levels:
            levels_now = alternate_rounds({m: s.port for m, s in servers.items()}, texts, c, args)
            for mode in modes:
                lv = levels_now[mode]
                res["modes"][mode]["levels"].append(lv)
                print(f"{mode:12s} clients {c:4d}: {lv['throughput_rps']:8.1f} req/s  p50 {lv.get('p50_ms')} "
                      f"p99 {lv.get('p99_ms')} ms  mean batch {lv['mean_batch']}  {lv['status_counts']}", flush=True)
    res["machine"]["uptime_at_end"] = uptime_text()
    _, md = write_record(res, out_dir, f"{args.name}_tokens", tokens_markdown)
    print(md.read_text())
    return 0


def run_docker(*args: str, timeout: float = 120) -> str:
    """`docker ARGS`: its stdout; RuntimeError with the end of its stderr where it fails."""
    r = subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        raise RuntimeError(f"docker {' '.join(args[:2])} failed: {r.stderr.strip()[-500:]}")
    return r.stdout.strip()


# A seccomp profile that refuses AMX tile data to the container (arch_prctl ARCH_REQ_XCOMP_PERM, which oneDNN and
# ONNX Runtime ask for before their first AMX instruction) and allows every other call: in it both runtimes run
# their AVX-512 VNNI kernels, and HoloServe serves the CPU as one without AMX.
DENY_AMX_SECCOMP = {
    "defaultAction": "SCMP_ACT_ALLOW",
    "syscalls": [{"names": ["arch_prctl"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1,
                  "args": [{"index": 0, "value": 0x1023, "op": "SCMP_CMP_EQ"}]}],
}


def docker_options(cpus: float | None, deny_amx: bool, folder: Path) -> list[str]:
    """`docker run` options for every container of a run: `--cpus` when given; with deny_amx, the seccomp
    profile above (written into `folder`, where the docker client reads it)."""
    out = ["--cpus", f"{cpus:g}"] if cpus else []
    if deny_amx:
        path = Path(folder) / "deny-amx-seccomp.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(DENY_AMX_SECCOMP, indent=1), encoding="utf-8")
        out += ["--security-opt", f"seccomp={path.resolve()}"]
    return out


def start_container(image: str, ckpt: Path, env: dict[str, str], options: list[str] | None = None
                    ) -> tuple[str, int, dict]:
    """`docker run -d` of `image` as a user runs it (checkpoint read-only at /model, port on loopback, plus
    `options`, e.g. from docker_options): (container id, host port, its /v1/models backend entry with the batches
    it runs at once as `instances`) once ready."""
    args = ["run", "-d", "-p", "127.0.0.1::8000", "-v", f"{ckpt.resolve()}:/model:ro", *(options or [])]
    for k, v in env.items():
        args += ["-e", f"{k}={v}"]
    cid = run_docker(*args, image)
    port = int(run_docker("port", cid, "8000/tcp").splitlines()[0].rsplit(":", 1)[1])
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
                if r.status == 200:
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as m:
                        model = json.loads(m.read())["models"][0]
                        return cid, port, {**model["backend"],
                                           "instances": (model.get("batching") or {}).get("instances")}
        except Exception:
            if run_docker("inspect", "-f", "{{.State.Running}}", cid) != "true":
                raise RuntimeError(f"the container exited: {run_docker('logs', cid)[-2000:]}")
            time.sleep(0.5)
    raise TimeoutError("the container did not become ready in 300 s")


def profile_pins(ckpt: Path | None) -> dict[str, str]:
    """The settings that pin a server to what the checkpoint's serving profile decides (backend or routed pair,
    OpenVINO's static shapes, the 2:4 kernels on or off), as `--workers N` pins its workers; {} without a
    readable profile. A server given another instance count than the profile's key would otherwise time the
    backends at start-up and could serve another."""
    from holoserve.backends.auto import ROUTE_ENV
    from holoserve.backends.profile import PROFILE_FILE
    from holoserve.server.config import env_name

    try:
        decision = json.loads((Path(ckpt) / PROFILE_FILE).read_text())["decision"] if ckpt else None
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    if not isinstance(decision, dict) or not decision.get("backend"):
        return {}
    if decision["backend"] == "routed":
        route = {k: decision[k] for k in ("small", "large", "max_small_tokens", "max_small_rows") if k in decision}
        env = {ROUTE_ENV: json.dumps(route)}
    else:
        env = {env_name("backend"): str(decision["backend"])}
    if decision.get("openvino_shapes"):
        env[env_name("openvino_shapes")] = ",".join(decision["openvino_shapes"])
    if decision.get("openvino_kernels") in ("on", "off"):
        env[env_name("openvino_kernels")] = decision["openvino_kernels"]
    return env


def env_settings(text: str) -> dict[str, str] | None:
    """{HOLOSERVE_X: V} from "HOLOSERVE_X=V[,HOLOSERVE_Y=W]" (a value may hold commas:
    HOLOSERVE_OPENVINO_SHAPES=1x64,8x64); None where a name is not a HoloServe setting or a value is empty."""
    pairs: list[list[str]] = []
    for piece in text.split(","):
        if "=" not in piece and pairs:
            pairs[-1][1] += "," + piece
        else:
            key, _, value = piece.partition("=")
            pairs.append([key, value])
    if pairs and all(k.startswith("HOLOSERVE_") and v for k, v in pairs):
        return {k: v for k, v in pairs}
    return None


def versus_variant(versus: str, image: str, ckpt: Path | None = None) -> tuple[str, str, dict[str, str]]:
    """(name, image, environment) of the container `docker run`'s defaults are held against: the same image
    forced to ONNX Runtime; the same image given the thread count the runtimes pick by themselves (one per
    physical core of the machine, whatever a CPU quota allows); the same image running one batch at a time
    (one-instance: `--instances 1`, all threads on each batch, pinned to what the checkpoint's serving profile
    decides, profile_pins); or `image:NAME`, another image (an earlier build) with its own defaults; or
    `env:HOLOSERVE_X=V,...`, the same image with those settings."""
    if versus == "onnxruntime":
        return "onnxruntime", image, {"HOLOSERVE_BACKEND": "onnxruntime"}
    if versus == "runtime-threads":
        from holoserve.core.machine import physical_cores

        cores = physical_cores(set(range(os.cpu_count() or 1)))
        return "runtime_threads", image, {"HOLOSERVE_THREADS": str(cores)}
    if versus == "one-instance":
        return "one_instance", image, {"HOLOSERVE_INSTANCES": "1", **profile_pins(ckpt)}
    if versus.startswith("image:") and versus[len("image:"):]:
        return versus[len("image:"):], versus[len("image:"):], {}
    if versus.startswith("env:"):
        settings = env_settings(versus[len("env:"):])
        if settings:
            return "env", image, settings
    raise SystemExit(f"--versus {versus!r}: use onnxruntime, runtime-threads, one-instance, image:NAME or "
                     "env:HOLOSERVE_X=V[,HOLOSERVE_Y=W] (the same image with those settings)")


def start_variants(order: list[str], variants: dict[str, tuple[str, dict]], ckpt: Path, options: list[str],
                   record: dict) -> dict[str, tuple[str, int]]:
    """Containers of `variants` started in `order`: {name: (container id, port)}. The first start of each fills
    its entry of `record` (image, settings, backend and why); a later start that serves another backend is noted
    there (`backends_seen`), since an `auto` choice made at start-up can differ between starts."""
    running: dict[str, tuple[str, int]] = {}
    try:
        for name in order:
            image, env = variants[name]
            cid, port, backend = start_container(image, ckpt, env, options)
            running[name] = (cid, port)
            entry = record.setdefault(name, {
                "image": image, "env": env, "backend": backend.get("backend"),
                "selection": backend.get("selection"), "threads": backend.get("threads_why"),
                "kernels": (backend.get("kernels") or {}).get("status"), "routing": backend.get("routing"),
                "instances": backend.get("instances"), "levels": [], "backends_seen": []})
            entry["backends_seen"].append(backend.get("backend"))
            print(f"{name}: {backend.get('backend')} ({backend.get('selection')})", flush=True)
    except BaseException:
        for cid, _ in running.values():
            subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)
        raise
    return running


def container_pids(running: dict[str, tuple[str, int]]) -> dict[str, int] | None:
    """Each container's main process (the server) as this machine sees it, for its CPU time; None where the
    engine's processes are out of sight (another PID namespace: a remote or nested engine)."""
    pids = {n: int(run_docker("inspect", "-f", "{{.State.Pid}}", cid)) for n, (cid, _) in running.items()}
    return pids if all(Path(f"/proc/{pid}/stat").exists() for pid in pids.values()) else None


def docker_main(args, ckpt: Path, texts: list[str], text_source: str, out_dir: Path) -> int:
    """The image as users meet it: `docker run` with no backend settings against a variant (--versus), both
    containers up (under --cpus when given), alternating rounds at each --clients level, on the same texts.
    With two or more rounds the run has two legs, the containers started fresh in the opposite order for the
    second: which of two identical containers starts first moved their throughput by a few per cent."""
    levels = [int(x) for x in args.clients.split(",")]
    other, other_image, other_env = versus_variant(args.versus, args.docker, ckpt)
    both = {}
    if getattr(args, "env", None):
        both = env_settings(args.env)
        if both is None:
            raise SystemExit(f"--env {args.env!r}: use HOLOSERVE_X=V[,HOLOSERVE_Y=W] (settings for both containers)")
    variants = {"default": (args.docker, dict(both)), other: (other_image, {**both, **other_env})}
    size = int(run_docker("image", "inspect", "-f", "{{.Size}}", args.docker))
    legs = [list(variants), list(variants)[::-1]] if args.rounds >= 2 else [list(variants)]
    res: dict = {"benchmark": "serve_load_docker", "date": _now(), "machine": machine(), "image": args.docker,
                 "cpus": args.cpus, "deny_amx": args.deny_amx, "versus": other,
                 "image_mb": round(size / 1e6), "checkpoint": ckpt.name, "texts": text_source,
                 "duration_s": args.duration, "rounds": args.rounds, "start_orders": legs,
                 "client": "asyncio HTTP/1.1 keep-alive, one process, closed loop", "env_both": both,
                 "variants": {}}
    options = docker_options(args.cpus, args.deny_amx, out_dir)
    turns: dict[str, dict[int, list]] = {n: {c: [] for c in levels} for n in variants}
    for leg, order in enumerate(legs):
        rounds = args.rounds // len(legs) + (args.rounds % len(legs) if leg == len(legs) - 1 else 0)
        running = start_variants(order, variants, ckpt, options, res["variants"])
        try:
            for name in order:
                warm(running[name][1], texts, 8, 2.0, 400)
            pids = container_pids(running)
            for c in levels:
                got = take_turns({n: p for n, (_, p) in running.items()}, texts, c, args, rounds, pids)
                for name, t in got.items():
                    turns[name][c].append(t)
                    lv = level_summary(c, [t])
                    print(f"leg {leg + 1} {name:11s} clients {c:3d}: {lv['throughput_rps']:8.1f} req/s  "
                          f"p50 {lv.get('p50_ms')} ms  {lv['status_counts']}", flush=True)
        finally:
            for cid, _ in running.values():
                subprocess.run(["docker", "rm", "-f", cid], capture_output=True, timeout=60)
    cpu = all(t["cpu"] > 0 for by in turns.values() for ts in by.values() for t in ts)
    for name, v in res["variants"].items():  # CPU per answer: the client's, and the container's server process'
        v["levels"] = [level_summary(c, turns[name][c], with_cpu=cpu) for c in levels]
    by = {n: {lv["clients"]: lv for lv in v["levels"]} for n, v in res["variants"].items()}
    res["summary"] = {}
    if 32 in levels:
        res["summary"]["throughput_ratio_32"] = round(by["default"][32]["throughput_rps"]
                                                      / by[other][32]["throughput_rps"], 3)
        res["summary"]["p99_ratio_32"] = round(by["default"][32]["p99_ms"] / by[other][32]["p99_ms"], 3)
    if 1 in levels:
        res["summary"]["p50_ratio_1"] = round(by["default"][1]["p50_ms"] / by[other][1]["p50_ms"], 3)
    if 32 in levels and len(legs) > 1:  # the two start orders apart: how much the order moved the ratio
        res["summary"]["throughput_ratio_32_by_leg"] = [
            round(level_summary(32, [turns["default"][32][i]])["throughput_rps"]
                  / level_summary(32, [turns[other][32][i]])["throughput_rps"], 3) for i in range(len(legs))]
    res["machine"]["uptime_at_end"] = uptime_text()
    write_record(res, out_dir, f"{args.name}_docker", docker_markdown)
    print(json.dumps(res["summary"], indent=2))
    return 0
