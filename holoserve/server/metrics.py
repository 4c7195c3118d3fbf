"""Prometheus metrics, named after Triton's `nv_inference_*` family so dashboards port.

Triton                                  HoloServe
nv_inference_request_success            holoserve_inference_request_success_total
nv_inference_request_failure            holoserve_inference_request_failure_total{reason}
nv_inference_count / _exec_count        holoserve_inference_count_total / holoserve_inference_exec_count_total
nv_inference_request_duration_us        holoserve_inference_request_duration_seconds (histogram)
nv_inference_queue_duration_us          holoserve_inference_queue_duration_seconds (histogram)
nv_inference_compute_input_duration_us  holoserve_inference_compute_input_duration_seconds (tokenization)
nv_inference_compute_infer_duration_us  holoserve_inference_compute_infer_duration_seconds (per batch)
nv_inference_pending_request_count      holoserve_inference_pending_request_count (queue depth, sequences)
(batch-size histogram)                  holoserve_inference_batch_size
(HTTP)                                  holoserve_http_request_duration_seconds{route,method,status},
                                        holoserve_http_requests_in_flight
(connections)                           holoserve_http_connections (open),
                                        holoserve_http_connections_closed_total{reason} (closed by the
                                        server's limits: header_too_large, header_timeout, body_timeout,
                                        send_timeout, send_budget, bad_request, evicted, refused)
(readiness)                             holoserve_model_ready, holoserve_workers_ready
Each app owns its registry, so several apps (tests) can live in one process.

Several worker processes (`--workers N`) report as one server: `holoserve serve` points
PROMETHEUS_MULTIPROC_DIR at a fresh folder before the workers start (prometheus-client's multiprocess
mode, chosen when it is imported), each worker writes its values there, and /metrics, whichever
worker answers it, adds up the files of all of them: counters and histograms are summed over every
worker that ever ran (a dead worker's requests still happened), gauges over live workers only (queue
depth, requests in flight, connections, ready workers: `live*` modes), and model_ready is the most
over live workers: 1 when a worker can answer, as /readyz says (a worker that is not warm takes no
connections; holoserve_workers_ready counts the warm ones).

A worker that stops gracefully removes its gauge files itself; one that is killed (SIGKILL, the
kernel's OOM killer) cannot, and its last values would stay in the totals for ever. So each /metrics
first removes the live-gauge files of processes that no longer run (`reap_dead_workers`): a pid that
does not exist, is a zombie, or is no longer a sibling of this worker (the pid was reused). It is
done where the files are read, so it holds whoever restarts the workers (uvicorn's supervisor
replaces a dead one) and needs no hook in the parent process.
"""
from __future__ import annotations

import glob
import os
import re
import tempfile

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest, values
from prometheus_client.exposition import CONTENT_TYPE_LATEST

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"

LATENCY_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)

CONTENT_TYPE = CONTENT_TYPE_LATEST


def multiprocess_active() -> bool:
    """Metric values live in PROMETHEUS_MULTIPROC_DIR's files (the variable was set when prometheus-client
    was imported)."""
    return values.ValueClass is not values.MutexValue and bool(os.environ.get(MULTIPROC_ENV))


def prepare_multiprocess_dir(workers: int) -> tuple[str | None, bool]:
    """Before the server starts: the folder for multiprocess metrics and whether it was made here (to
    remove at exit). A PROMETHEUS_MULTIPROC_DIR already set is used, after its value files (*.db) from
    an earlier run are deleted (they would be added to this run's); otherwise, with several workers, a
    fresh temporary folder is made and exported for the workers to inherit."""
    path = os.environ.get(MULTIPROC_ENV)
    if path:
        os.makedirs(path, exist_ok=True)
        for f in glob.glob(os.path.join(path, "*.db")):
            os.remove(f)
        return path, False
    if workers <= 1:
        return None, False
    path = tempfile.mkdtemp(prefix="holoserve-metrics-")
    os.environ[MULTIPROC_ENV] = path
    return path, True


_LIVE_GAUGE = re.compile(r"^gauge_live[a-z]+_(\d+)\.db$")


def _is_sibling(pid: int) -> bool:
    """`pid` is this process or a running process with the same parent (another worker)."""
    if pid == os.getpid():
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except FileNotFoundError:
        return False
    except OSError:  # no /proc (not Linux): whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        return True
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses, so split after its last ')'.
    fields = stat[stat.rfind(b")") + 2:].split()
    return len(fields) > 1 and fields[0] not in (b"Z", b"X") and int(fields[1]) == os.getppid()


def reap_dead_workers(path: str) -> list[int]:
    """Remove the live-gauge files of processes that no longer run; returns their pids."""
    dead: set[int] = set()
    try:
        names = os.listdir(path)
    except FileNotFoundError:
        return []
    pids: dict[int, list[str]] = {}
    for name in names:
        m = _LIVE_GAUGE.match(name)
        if m:
            pids.setdefault(int(m.group(1)), []).append(name)
    for pid, files in pids.items():
        if _is_sibling(pid):
            continue
        dead.add(pid)
        for name in files:
            try:
                os.remove(os.path.join(path, name))
            except FileNotFoundError:  # another worker reaped it first
                pass
    return sorted(dead)


class ServerMetrics:
    def __init__(self, model: str, version: str) -> None:
        self.multiprocess = multiprocess_active()
        self.registry = r = CollectorRegistry(auto_describe=True)
        lab = ("model", "version")
        self.labels = {"model": model, "version": version}
        self.success = Counter("holoserve_inference_request_success", "Successful /predict requests", lab, registry=r)
        self.failure = Counter("holoserve_inference_request_failure", "Failed /predict requests by reason",
                               (*lab, "reason"), registry=r)
        self.count = Counter("holoserve_inference_count", "Sequences inferred (one per text or pair)", lab, registry=r)
        self.exec_count = Counter("holoserve_inference_exec_count", "Batched backend executions", lab, registry=r)
        self.request_duration = Histogram("holoserve_inference_request_duration_seconds",
                                          "End-to-end /predict handling time inside the server", lab,
                                          buckets=LATENCY_BUCKETS, registry=r)
        self.queue_duration = Histogram("holoserve_inference_queue_duration_seconds",
                                        "Time a request waited in the batching queue", lab, buckets=LATENCY_BUCKETS,
                                        registry=r)
        self.input_duration = Histogram("holoserve_inference_compute_input_duration_seconds",
                                        "Tokenization time per request", lab, buckets=LATENCY_BUCKETS, registry=r)
        self.infer_duration = Histogram("holoserve_inference_compute_infer_duration_seconds",
                                        "Backend time per batch execution (padding included)", lab,
                                        buckets=LATENCY_BUCKETS, registry=r)
        self.batch_size = Histogram("holoserve_inference_batch_size", "Sequences per backend execution", lab,
                                    buckets=BATCH_BUCKETS, registry=r)
        self.pending = Gauge("holoserve_inference_pending_request_count",
                             "Sequences waiting for inference (queue depth)", lab, registry=r,
                             multiprocess_mode="livesum")
        self.ready = Gauge("holoserve_model_ready", "1 when the model is loaded and warmed up (with several "
                           "workers: when one is)", lab, registry=r, multiprocess_mode="livemax")
        self.workers_ready = Gauge("holoserve_workers_ready", "Server processes with the model loaded and warmed up",
                                   lab, registry=r, multiprocess_mode="livesum")
        self.http_duration = Histogram("holoserve_http_request_duration_seconds", "HTTP request latency",
                                       ("route", "method", "status"), buckets=LATENCY_BUCKETS, registry=r)
        self.in_flight = Gauge("holoserve_http_requests_in_flight", "HTTP requests being handled", registry=r,
                                 multiprocess_mode="livesum")
        self.connections = Gauge("holoserve_http_connections", "Open HTTP connections", registry=r,
                                 multiprocess_mode="livesum")
        self.connections_closed = Counter("holoserve_http_connections_closed",
                                          "Connections closed by the server's connection limits, by reason",
                                          ("reason",), registry=r)
        # Bound children once: label lookups are the costly part of an observation.
        self.success_l = self.success.labels(**self.labels)
        self.count_l = self.count.labels(**self.labels)
        self.exec_count_l = self.exec_count.labels(**self.labels)
        self.request_duration_l = self.request_duration.labels(**self.labels)
        self.queue_duration_l = self.queue_duration.labels(**self.labels)
        self.input_duration_l = self.input_duration.labels(**self.labels)
        self.infer_duration_l = self.infer_duration.labels(**self.labels)
        self.batch_size_l = self.batch_size.labels(**self.labels)
        self.pending_l = self.pending.labels(**self.labels)
        self.ready_l = self.ready.labels(**self.labels)
        self.workers_ready_l = self.workers_ready.labels(**self.labels)

    def set_ready(self, ready: bool) -> None:
        self.ready_l.set(int(ready))
        self.workers_ready_l.set(int(ready))

    def fail(self, reason: str) -> None:
        self.failure.labels(**self.labels, reason=reason).inc()

    def render(self) -> bytes:
        if self.multiprocess:
            from prometheus_client.multiprocess import MultiProcessCollector

            reap_dead_workers(os.environ[MULTIPROC_ENV])
            registry = CollectorRegistry()
            MultiProcessCollector(registry)
            return generate_latest(registry)
        return generate_latest(self.registry)

    def close(self) -> None:
        """At process exit: drop this process's live gauges from the multiprocess totals."""
        if self.multiprocess:
            from prometheus_client.multiprocess import mark_process_dead

            mark_process_dead(os.getpid())
