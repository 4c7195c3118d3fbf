"""The hostile benchmark's page and its summary of failures by phase."""
from __future__ import annotations

from pathlib import Path

from bench.hostile.bounded import bounded_failures, bounded_rows
from holoserve.core.files import atomic_write_text


def write_markdown(res: dict, path: Path) -> None:
    m, s = res["machine"], res["summary"]
    lines = [
        f"# Hostile load: {res['checkpoint']} on {m['cores']}-core {m['arch']} CPU",
        "",
        f"{res['date']} · {m['cpu']} · server settings {res['server_settings']} · server open-file limit "
        f"{res['server_nofile'] or 'inherited'} · `{res['command']}`",
        "",
        f"**{s['requests_tried']} requests and {s['connections_tried']} hostile connections tried; "
        f"{s['failures_total']} failures.**",
        "",
        "| failure kind | count |",
        "| --- | ---: |",
    ]
    lines += [f"| {k} | {v} |" for k, v in sorted(s["failures_by_kind"].items())] or ["| (none) | 0 |"]
    st = res["settings"]
    lines += ["", "## 1. Settings the model cannot honour",
              f"`--max-seq-length {st['max_seq_length']}` (the position table holds {st['position_table']}): "
              + ("refused at start (exit code {}): {}".format(st["exit_code"], st["message"]) if st["refused"]
                 else "**the server started**; the mixed load below ran against it.")]
    lines += ["", "## 2. Fuzz cases", "", "| case | outcome | expected | failure |", "| --- | --- | --- | --- |"]
    for c in res["fuzz"]["cases"]:
        lines.append(f"| {c['case']} | {', '.join(map(str, c['outcomes']))} | {', '.join(c['expected'])} | "
                     f"{c['failure'] or '-'} |")
    mx = res["mixed"]
    lines += ["", "## 3. Mixed bad/good load",
              f"{mx['good']} good and {mx['bad']} bad requests from {mx['clients']} keep-alive clients in "
              f"{mx['wall_s']} s.", "", "| kind | statuses |", "| --- | --- |"]
    lines += [f"| {k} | {v} |" for k, v in sorted(mx["status_by_kind"].items())]
    sl = res["slow"]
    lines += ["", "## 4. Slow connections",
              f"Held {sl['held_s']} s (the server's timeouts: header {res['timeouts']['header']} s, body "
              f"{res['timeouts']['body']} s); legitimate requests meanwhile: {sl['legit_ok']}/{sl['legit_tried']} "
              f"answered 200. Server memory: {sl['server_rss_mb_before']} MB before, peak "
              f"{sl['server_peak_rss_mb']} MB.", "", "| attack | connections | still open after the hold |",
              "| --- | ---: | ---: |"]
    lines += [f"| {k} | {v} | {sl['still_open_after_hold'][k]} |" for k, v in sl["attack_connections"].items()]
    fl = res["flood"]
    lines += ["", "## 5. Connection flood",
              f"{fl['stalled_connections']} stalled connections: {fl['closed_by_server']} closed by the server; "
              f"legitimate requests meanwhile: {fl['legit_ok']}/{fl['legit_tried']} answered 200."]
    if "v2" in res:
        lines += ["", "## 6. KServe v2 edges",
                  "Every 4xx answer on a /v2 path must carry the protocol's `{\"error\": \"...\"}` body.", "",
                  "| case | outcome | expected | failure |", "| --- | --- | --- | --- |"]
        for c in res["v2"]["cases"]:
            lines.append(f"| {c['case']} | {', '.join(map(str, c['outcomes']))} | {', '.join(c['expected'])} | "
                         f"{c['failure'] or '-'} |")
        lv = res["leavers"]
        lines += ["", f"{lv['connections']} clients sent three pipelined 64-text requests each and reset the "
                  f"connection while the first was answered; error-level lines in the server's log over phases 2-8: "
                  f"{res['server_log_errors']}."]
    if "amplification" in res:
        am = res["amplification"]
        b, u = am["baseline"], am["under_attack"]
        lines += ["", "## 7. Output amplification",
                  f"{am['attackers']} clients sending a 0.9 MB v2 request with 64 texts and one output named 50,000 "
                  f"times, in a loop, and {am['non_readers']} that send it twice and never read, for "
                  f"{am['seconds']} s beside {am['clients']} neighbours (keep-alive, /predict and v2 in turn). "
                  f"Attack answers: {am['attack_statuses']}. Server peak RSS during the attack: "
                  f"{am['server_peak_rss_mb']} MB.", "",
                  "| neighbours | requests | failed | p50 ms | p99 ms | max ms |",
                  "| --- | ---: | ---: | ---: | ---: | ---: |",
                  f"| alone | {b['tried']} | {b['failed']} | {b['p50_ms']} | {b['p99_ms']} | {b['max_ms']} |",
                  f"| beside the attack | {u['tried']} | {u['failed']} | {u['p50_ms']} | {u['p99_ms']} | "
                  f"{u['max_ms']} |"]
    if "unread" in res:
        ur = res["unread"]
        nb = ur["neighbours"]
        lines += ["", "## 8. Answers nobody reads",
                  f"{ur['connections']} connections each pipelined {ur['pipelined']} v2 requests whose answers are "
                  f"~{ur['answer_bytes'] // 1000} kB (a long id, echoed) and never read them (4 kB receive buffer); "
                  f"send timeout {ur['send_timeout_s']} s. Aborted by the server: "
                  f"{ur['aborted_by_server']}/{ur['connections']} ({ur.get('aborted_by_reason')}, the last "
                  f"{ur.get('all_aborted_after_s')} s after they connected). Neighbours in the first "
                  f"{ur['held_s']} s: {nb['tried'] - nb['failed']}/"
                  f"{nb['tried']} answered 200 (p99 {nb['p99_ms']} ms, max {nb['max_ms']} ms). Server peak RSS: "
                  f"{ur['server_peak_rss_mb']} MB."]
    if "workers" in res:
        wk = res["workers"]
        nb = wk.get("neighbours", {})
        lines += ["", "## 9. `--workers 2` with a token: a worker SIGKILLed under load", "",
                  "| auth case | status | expected | failure |", "| --- | ---: | ---: | --- |"]
        lines += [f"| {c['case']} | {c['status']} | {c['expected']} | {c['failure'] or '-'} |"
                  for c in wk.get("auth_cases", [])]
        lines += ["", f"{wk.get('clients')} neighbours on fresh connections for 6 s; one worker SIGKILLed at 2 s. "
                  f"Neighbour requests: {nb.get('tried')}, failed {nb.get('failed')} (in flight at the kill: "
                  f"{wk.get('in_flight_at_kill')}; failed among those sent after it: "
                  f"{wk.get('failed_after_kill_sent')}). "
                  f"Replacement worker running after {wk.get('replaced_after_s')} s. /metrics agreed with /readyz "
                  f"(ready, 1 request and 1 connection open: the scrape's) {wk.get('metrics_consistent_after_s')} s "
                  f"after the load ended; last scrape {wk.get('last_scrape')}. Workers' peak RSS (sum): "
                  f"{wk.get('workers_peak_rss_mb')} MB."]
    if res.get("server_counters"):
        lines += ["", f"Connections the server closed, by reason (its metrics): {res['server_counters']}"]
    if "bounded" in res:
        lines += ["", "## 10. Work and memory bounded before anything is done", ""] + bounded_rows(res["bounded"])
    atomic_write_text(path, "\n".join(lines) + "\n")


def summarize(res: dict) -> dict:
    failures: dict[str, int] = {}

    def add(kind: str, n: int = 1) -> None:
        if n:
            failures[kind] = failures.get(kind, 0) + n

    if not res["settings"]["refused"]:
        add("settings: started with a sequence length the model cannot take")
    for k, v in res["fuzz"]["failures"].items():
        add(f"fuzz: {k}", v)
    for k, v in res["mixed"]["failures"].items():
        add(f"mixed: {k}", v)
    sl = res["slow"]
    for k, v in sl["still_open_after_hold"].items():
        add(f"slow: {k} connection still open after {sl['held_s']} s", v)
    add("slow: legitimate request failed", sl["legit_tried"] - sl["legit_ok"])
    fl = res["flood"]
    add("flood: legitimate request failed", fl["legit_tried"] - fl["legit_ok"])
    tried = res["fuzz"]["tried"] + res["mixed"]["tried"] + sl["legit_tried"] + fl["legit_tried"]
    conns = sum(sl["attack_connections"].values()) + fl["stalled_connections"]
    if "v2" in res:
        for k, v in res["v2"]["failures"].items():
            add(f"v2: {k}", v)
        add("server log: error-level lines", res["server_log_errors"])
        tried += res["v2"]["tried"]
        conns += res["leavers"]["connections"]
    if "amplification" in res:
        am = res["amplification"]
        add("amplification: attack request not refused with 400",
            sum(v for k, v in am["attack_statuses"].items() if k != "400"))
        add("amplification: neighbour request failed", am["baseline"]["failed"] + am["under_attack"]["failed"])
        tried += am["baseline"]["tried"] + am["under_attack"]["tried"] + sum(am["attack_statuses"].values())
        conns += am["non_readers"]
    if "unread" in res:
        ur = res["unread"]
        add("unread: neighbour request failed", ur["neighbours"]["failed"])
        add("unread: connection not aborted after the send timeout", ur["connections"] - ur["aborted_by_server"])
        tried += ur["neighbours"]["tried"]
        conns += ur["connections"]
    if "workers" in res:
        wk = res["workers"]
        if "error" in wk:
            add(f"workers: {wk['error']}")
        else:
            for c in wk["auth_cases"]:
                add(f"workers: auth case {c['case']!r}", c["failure"] is not None)
            nb = wk["neighbours"]
            add("workers: neighbour failures beyond the requests in flight at the kill",
                max(0, nb["failed"] - wk["in_flight_at_kill"]))
            add("workers: a request sent after the kill failed", wk["failed_after_kill_sent"])
            add("workers: /metrics not consistent with /readyz within 5 s", wk["metrics_consistent_after_s"] is None)
            add("workers: the dead worker was not replaced", wk["replaced_after_s"] is None)
            tried += nb["tried"] + len(wk["auth_cases"])
    if "bounded" in res:
        for kind, n in bounded_failures(res["bounded"]).items():
            add(f"bounded: {kind}", n)
    return {"requests_tried": tried, "connections_tried": conns, "failures_total": sum(failures.values()),
            "failures_by_kind": failures}
