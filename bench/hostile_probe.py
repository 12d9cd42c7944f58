#!/usr/bin/env python3
"""Black-box adversarial probe of a running ``trainguard serve`` (HTTP ingest, query API, gRPC): the brief's
rule 4 -- bad input gets a clear 4xx (or a per-event rejection naming the field) and loses nothing else; no
project can hurt another.

It starts a fresh ``trainguard serve`` with its defaults (or probes one given by ``--url`` + ``--tokens``),
makes projects A (the victim) and B (the attacker) with their own ingest and read tokens, gives each a run
with a NaN-loss incident, then sends every attack below as B over real sockets (``http.client``, raw
sockets for what no client would send, ``grpcio`` with raw bytes). After each attack A sends one event
(its answer must be 200, ``accepted: 1``). An attack *fails* when it is answered 5xx, does not finish within
``--timeout`` s, leaves ``/readyz`` not 200, or when A's event is not accepted; B reading or writing A's
things must get 404 / ``wrong_project``. At the end every event A sent must be readable with A's read
token (nothing lost) and A's incident still there. Prints one line per attack and a summary; exit status 1
when any attack failed.

    python bench/hostile_probe.py                  # ~1-2 minutes on a 2-core machine
    python bench/hostile_probe.py --only api       # attacks whose name starts with "api"

Attacks: deeply nested JSON, huge numbers, NaN/Inf as strings and bare literals, duplicate keys, wrong and
doubled content types, oversized and many headers, absent / wrong / other-kind / other-project tokens, many
tiny requests, unicode (astral, RTL, combining, noncharacters, escaped lone surrogates) in every field, ids
holding path characters, each query-API route (GET, POST, PUT) with hostile path and query values and
bodies, and gRPC with garbage, other-project events and hostile metadata.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple
from urllib.parse import quote

REPO = Path(__file__).resolve().parent.parent
for _src in (REPO / "sdk" / "src", REPO / "services" / "src", REPO / "engine" / "src", REPO):
    if str(_src) not in sys.path:
        sys.path.insert(0, str(_src))

Answer = Tuple[int, bytes]

# ------------------------------------------------------------------------------------------ the server


class Target:
    """Where the server listens and the two projects' tokens."""

    def __init__(self, host: str, port: int, grpc_port: int, tokens: Dict[Tuple[str, str], str]) -> None:
        self.host, self.port, self.grpc_port, self.tokens = host, port, grpc_port, tokens

    def token(self, project: str, kind: str) -> str:
        return self.tokens[(project, kind)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def spawn(data_dir: Path,
          settings: Optional[Dict[str, str]] = None) -> Tuple[subprocess.Popen[bytes], Target]:
    """A fresh ``trainguard serve`` (defaults, less ``settings``: ``TRAINGUARD_*`` variables) with projects
    A and B."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINGUARD_")}
    env.update(settings or {})
    env["PYTHONPATH"] = os.pathsep.join(str(REPO / d / "src") for d in ("sdk", "engine", "services"))
    tokens: Dict[Tuple[str, str], str] = {}
    for project in "AB":
        for kind in ("ingest", "read"):
            out = subprocess.run([sys.executable, "-m", "trainguard_server", "token", "create", "--project",
                                  project, "--kind", kind, "--data-dir", str(data_dir)], env=env, check=True,
                                 capture_output=True, text=True).stdout
            tokens[(project, kind)] = next(w for w in out.split() if w.startswith(f"tg_{kind}_"))
    port, grpc_port = _free_port(), _free_port()
    log = open(data_dir / "serve.log", "wb")
    proc = subprocess.Popen([sys.executable, "-m", "trainguard_server", "serve", "--data-dir", str(data_dir),
                             "--http-port", str(port), "--grpc-port", str(grpc_port)], stdout=log,
                            stderr=subprocess.STDOUT, env=env, start_new_session=True)
    target = Target("127.0.0.1", port, grpc_port, tokens)
    deadline = time.monotonic() + 60
    while True:
        try:
            if request(target, "GET", "/readyz", timeout=2)[0] == 200:
                return proc, target
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            log_text = (data_dir / "serve.log").read_text()[-2000:]
            raise RuntimeError(f"trainguard serve did not start: {log_text}")
        time.sleep(0.1)


# ------------------------------------------------------------------------------------------- requests

SLOW: List[Tuple[float, str]] = []


def request(t: Target, method: str, path: str, body: bytes = b"", headers: Optional[Dict[str, str]] = None,
            timeout: float = 40.0) -> Answer:
    """The status and body of one request (status 0: the connection was reset or closed, body says how;
    -1: the answer's body was cut off)."""
    conn = http.client.HTTPConnection(t.host, t.port, timeout=timeout)
    started = time.monotonic()
    try:
        conn.request(method, path, body=body if body or method in ("POST", "PUT") else None,
                     headers=headers or {})
        r = conn.getresponse()
        try:
            return r.status, r.read()
        except http.client.IncompleteRead as exc:
            return -1, f"{r.status} cut off after {len(exc.partial)} bytes: {method} {path[:200]}".encode()
    except (ConnectionError, http.client.RemoteDisconnected) as exc:
        return 0, f"{exc!r}: {method} {path[:100]}".encode()
    finally:
        conn.close()
        took = time.monotonic() - started
        if took > 2:
            SLOW.append((took, f"{method} {path[:160]}"))


def raw(t: Target, data: bytes, timeout: float = 40.0) -> Answer:
    """``data`` as is over one connection; the status of the first answer (0: closed without one)."""
    with socket.create_connection((t.host, t.port), timeout=timeout) as conn:
        try:
            conn.sendall(data)
        except OSError:
            pass  # the server may close before reading it all (e.g. a 431)
        out = b""
        try:
            while b"\r\n\r\n" not in out:
                chunk = conn.recv(65536)
                if not chunk:
                    break
                out += chunk
        except ConnectionResetError:
            pass
    head = out.split(b"\r\n", 1)[0].split()
    return (int(head[1]) if len(head) > 1 and head[1].isdigit() else 0), out[:400]


def auth(t: Target, project: str, kind: str) -> Dict[str, str]:
    return {"Authorization": f"Bearer {t.token(project, kind)}"}


def ingest(t: Target, project: str, body: Any, ctype: str = "application/json",
           extra: Optional[Dict[str, str]] = None) -> Answer:
    headers = {**auth(t, project, "ingest"), "Content-Type": ctype, **(extra or {})}
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return request(t, "POST", "/v1/ingest", data, headers)


def read(t: Target, project: str, path: str) -> Answer:
    return request(t, "GET", path, headers=auth(t, project, "read"))


def event(run_id: str, step: Any = 0, value: Any = 1.0, name: str = "loss", **fields: Any) -> Dict[str, Any]:
    out: Dict[str, Any] = {"event_id": uuid.uuid4().hex, "run_id": run_id, "step": step,
                           "time_unix_nano": time.time_ns(), "severity": "INFO",
                           "metrics": {"points": [{"name": name, "value": value}]}}
    out.update(fields)
    return out


def body(*events: Dict[str, Any]) -> bytes:
    return json.dumps({"events": list(events)}).encode()


# -------------------------------------------------------------------------------------------- attacks

Attack = Callable[[Target, Dict[str, Any]], Any]
ATTACKS: List[Tuple[str, Attack]] = []


def attack(name: str) -> Callable[[Attack], Attack]:
    def register(fn: Attack) -> Attack:
        ATTACKS.append((name, fn))
        return fn
    return register


def _many(*answers: Answer) -> List[Answer]:
    return list(answers)


NESTED = 100_000
UNICODE = ["损失", "خسارة", "🔥\U0001F600", "e\u0301\u0301\u0301", "\uffff\U0010ffff", "\u200d\u2060",
           "a" * 500 + "\u00e9"]


@attack("ingest/nested-json")
def _(t: Target, s: Dict[str, Any]) -> Any:
    return _many(ingest(t, "B", b'{"events": ' + b"[" * NESTED + b"]" * NESTED + b"}"),
                 ingest(t, "B", b'{"events": [' + b'{"a":' * NESTED + b"1" + b"}" * NESTED + b"]}"),
                 ingest(t, "B", body(event("b", value=json.loads("[" * 900 + "]" * 900)))),
                 ingest(t, "B", b"[" * 5_000_000))


@attack("ingest/huge-numbers")
def _(t: Target, s: Dict[str, Any]) -> Any:
    digits = "9" * 5000
    return _many(ingest(t, "B", body(event("b", value=1e308 * 10))),
                 ingest(t, "B", ('{"events": [' + json.dumps(event("b"))[:-1] + ', "pid": ' + digits + "}]}")
                        .encode()),
                 ingest(t, "B", body(event("b", step=2**70))),
                 ingest(t, "B", body(event("b", step=-(2**63) - 1))),
                 ingest(t, "B", body(event("b", time_unix_nano=10**30))),
                 ingest(t, "B", ('{"events": [' + json.dumps(event("b"))[:-1] + ', "rank": 1e99999}]}')
                        .encode()),
                 ingest(t, "B", b'{"events": [], "x": 0.' + b"1" * 1_000_000 + b"}"))


@attack("ingest/nan-inf")
def _(t: Target, s: Dict[str, Any]) -> Any:
    out = []
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"nan", b"inf"):
        e = json.dumps(event("b")).encode().replace(b'"value": 1.0', b'"value": ' + literal)
        out.append(ingest(t, "B", b'{"events": [' + e + b"]}"))
    for text in ("NaN", "Infinity", "-Infinity", "nan", "inf", "-nan", "1e999", "0x10", ""):
        out.append(ingest(t, "B", body(event("b", value=text))))
        out.append(ingest(t, "B", body(event("b", step=text))))
    return out


@attack("ingest/lone-surrogates")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """H47 (stop 45): a lone surrogate ("\\udfff" in the JSON) where the rejection quotes what was sent -- a
    tag key, a stats key, an unknown field's name, an enum's text, the event id, a too-deep field's name --
    each beside a clean event: 200, that event rejected (before: 500, the clean one queued anyway)."""
    lone = "\udfff"
    bads = [event("b", lifecycle={"phase": "START", "tags": {lone: "v"}}),
            event("b", heartbeat={"last_step": 1, "sdk_stats": {lone: 1.0}}),
            event("b", **{f"x{lone}": 1}), event("b", severity=f"ERROR{lone}"),
            event("b", event_id=f"e{lone}")]
    for bad in bads[:2]:
        del bad["metrics"]  # one payload each
    out = [ingest(t, "B", body(event("b"), bad)) for bad in bads]
    deep = json.dumps(event("b"))[:-1] + ', "tags\\udfff": ' + "[" * 5000 + "]" * 5000 + "}"
    out.append(ingest(t, "B", ('{"events": [' + json.dumps(event("b")) + ", " + deep + "]}").encode()))
    return [(status, data) if status != 200 or json.loads(data).get("accepted") == 1
            else (500, b"not 1 accepted: " + data[:200]) for status, data in out]


@attack("ingest/duplicate-keys")
def _(t: Target, s: Dict[str, Any]) -> Any:
    e = json.dumps(event("b"))
    return _many(ingest(t, "B", b'{"events": [], "events": [' + e.encode() + b"]}"),
                 ingest(t, "B", ('{"events": [' + e[:-1] + ', "run_id": "other"}]}').encode()),
                 ingest(t, "B", b'{"events": [{"event_id": "a", "event\\u005fid": "b"}]}'))


@attack("ingest/content-types")
def _(t: Target, s: Dict[str, Any]) -> Any:
    ok = body(event("b"))
    out = [ingest(t, "B", ok, ctype) for ctype in (
        "text/plain", "application/json; charset=latin-1", "multipart/form-data; boundary=x",
        "application/x-www-form-urlencoded", "", "application/json, application/x-protobuf",
        "APPLICATION/JSON", "application/x-protobuf", "application/grpc")]
    out.append(ingest(t, "B", ok, extra={"Content-Encoding": "br"}))
    out.append(ingest(t, "B", ok, extra={"Content-Encoding": "gzip"}))
    out.append(raw(t, b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer "
                   + t.token("B", "ingest").encode()
                   + b"\r\nContent-Type: application/json\r\nContent-Type: text/plain\r\nContent-Length: "
                   + str(len(ok)).encode() + b"\r\n\r\n" + ok))
    return out


@attack("http/oversized-headers")
def _(t: Target, s: Dict[str, Any]) -> Any:
    tok = t.token("B", "ingest").encode()
    ok = body(event("b"))
    base = (b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + tok
            + b"\r\nContent-Type: application/json\r\n")
    return _many(raw(t, base + b"X-Big: " + b"a" * 100_000 + b"\r\nContent-Length: " + str(len(ok)).encode()
                     + b"\r\n\r\n" + ok),
                 raw(t, base + b"".join(b"X-%d: v\r\n" % i for i in range(10_000)) + b"Content-Length: "
                     + str(len(ok)).encode() + b"\r\n\r\n" + ok),
                 raw(t, base + b"X-Big: " + b"a" * 2_000_000 + b"\r\n\r\n"),
                 raw(t, b"GET /api/v1/runs?" + b"a" * 200_000 + b" HTTP/1.1\r\nHost: x\r\n\r\n"),
                 raw(t, b"GET /api/v1/runs HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + b"x" * 100_000
                     + b"\r\n\r\n"))


@attack("auth/tokens")
def _(t: Target, s: Dict[str, Any]) -> Any:
    ok = body(event("b"))
    out = []
    for value in (None, "Bearer", "Bearer ", "Basic YTpi", "bearer " + t.token("B", "ingest"),
                  "Bearer " + t.token("B", "read"), "Bearer " + t.token("B", "ingest") + "x",
                  "Bearer " + "x" * 8000,
                  "Bearer tg_ingest_\u00e9"):
        headers = {"Content-Type": "application/json"}
        if value is not None:
            headers["Authorization"] = value
        try:
            out.append(request(t, "POST", "/v1/ingest", ok, headers))
        except UnicodeEncodeError:
            out.append(raw(t, ("POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: " + str(value)
                               + "\r\nContent-Type: application/json\r\nContent-Length: " + str(len(ok))
                               + "\r\n\r\n").encode() + ok))
    for path in ("/api/v1/runs", f"/api/v1/runs/{s['a_run']}", "/api/v1/incidents", "/api/v1/search?q=loss"):
        out.append(request(t, "GET", path))
        out.append(request(t, "GET", path, headers=auth(t, "B", "ingest")))
    return out


@attack("tenant/cross-project")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """B's tokens against A's things: every answer 404 / wrong_project; A's run unchanged."""
    a_run, a_inc = s["a_run"], s["a_incident"]
    answers = [ingest(t, "B", body(event(a_run, 99, project="A")))]
    for path in (f"/api/v1/runs/{a_run}", f"/api/v1/runs/{a_run}/metrics", f"/api/v1/runs/{a_run}/events",
                 f"/api/v1/runs/{a_run}/incidents", f"/api/v1/runs/{a_run}/metrics/summary",
                 f"/api/v1/incidents/{a_inc}", f"/api/v1/incidents/{a_inc}/workflow",
                 f"/api/v1/runs/{a_run}/events/{s['a_event']}"):
        answers.append(read(t, "B", path))
    # B logs a NaN to its own run of the same name: B's run, B's incident; A's run is not touched
    answers.append(ingest(t, "B", body(event(a_run, 99, value="NaN"))))
    s["b_same_name"] = len(answers) - 1
    for verb, payload in (("acknowledge", {"by": "mallory"}),
                          ("resolve", {"by": "mallory", "root_cause": "x"}),
                          ("notes", {"by": "mallory", "text": "pwned"})):
        answers.append(request(t, "POST", f"/api/v1/incidents/{a_inc}/{verb}", json.dumps(payload).encode(),
                               {**auth(t, "B", "read"), "Content-Type": "application/json"}))
    s["cross"] = answers
    return answers


@attack("tenant/event-id-claim")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """B sends first the event ids A is about to use (a log and a metric batch): A's events must still be
    accepted and readable (de-duplication is per project)."""
    claimed = uuid.uuid4().hex
    s["claimed"] = claimed
    e = event("claim", 1, event_id=claimed, log={"logger": "b", "level": "INFO", "message": "B's",
                                                  "source": "logging"})
    del e["metrics"]
    return _many(ingest(t, "B", body(e)), ingest(t, "B", body(event("claim", 2, event_id=claimed))))


@attack("ingest/many-tiny-requests")
def _(t: Target, s: Dict[str, Any]) -> Any:
    def one(i: int) -> Answer:
        return ingest(t, "B", body(event(f"tiny-{i % 50}", i)))
    with ThreadPoolExecutor(32) as pool:
        return list(pool.map(one, range(3000)))


@attack("ingest/unicode-every-field")
def _(t: Target, s: Dict[str, Any]) -> Any:
    out = []
    for text in UNICODE:
        e = event(text, name=text, host=text, run_name=text, trace_id=text, sdk=text)
        log = event(text, log={"message": text * 3, "logger": text, "level": text, "source": text})
        del log["metrics"]
        exc = event(text, exception={"type": text, "message": text, "traceback": text,
                                     "context": {text: text},
                                     "frames": [{"filename": text, "function": text, "lineno": 1,
                                                 "module": text, "context_line": text}]})
        del exc["metrics"]
        out.append(ingest(t, "B", body(e, log, exc)))
    out.append(ingest(t, "B", b'{"events": [{"event_id": "x", "run_id": "\\ud800", "metrics": {}}]}'))
    out.append(ingest(t, "B", b'{"events": [{"event_id": "x", "run_id": "\\udfff\\ud800"}]}'))
    out.append(ingest(t, "B", b'{"events": [{"event_id": "x", "run_id": "ok", "metrics": {"points": '
                              b'[{"name": "\\u0000", "value": 1}]}}]}'))
    return out


PATHY = ["../x", "..", ".", "a/b", "a%2Fb", "a\\b", "a?b", "a#b", "%00", " ", "a b", "~", "a;b", "%2e%2e",
         "con", "a\u202eb", "\u00e9", "run\x00id", "x" * 300]


@attack("ingest/path-ids")
def _(t: Target, s: Dict[str, Any]) -> Any:
    out = [ingest(t, "B", body(event(run_id, trace_id=run_id, event_id=run_id))) for run_id in PATHY]
    out += [ingest(t, "B", body(event(run_id))) for run_id in PATHY]
    return out


def _api_paths(run: str, inc: str, event_id: str, fp: str, name: str) -> List[Tuple[str, str]]:
    return [("GET", f"/api/v1/runs/{run}"), ("GET", f"/api/v1/runs/{run}/metrics"),
            ("GET", f"/api/v1/runs/{run}/metrics/summary"), ("GET", f"/api/v1/runs/{run}/incidents"),
            ("GET", f"/api/v1/runs/{run}/events"), ("GET", f"/api/v1/runs/{run}/events/{event_id}"),
            ("GET", f"/api/v1/incidents/{inc}"), ("GET", f"/api/v1/incidents/{inc}/workflow"),
            ("GET", f"/api/v1/clusters/{fp}"), ("GET", f"/api/v1/baselines/{name}")]


@attack("api/hostile-path-ids")
def _(t: Target, s: Dict[str, Any]) -> Any:
    out = []
    for value in PATHY + UNICODE + ["%ff%fe", "%", "%zz", "x" * 100_000]:
        enc = quote(value, safe="%") if "%" in value else quote(value, safe="")
        for _method, path in _api_paths(enc, enc, enc, enc, enc):
            out.append(read(t, "B", path))
    return out


QUERY_VALUES = ["NaN", "nan", "inf", "-inf", "Infinity", "1e999", "-1", "0", "9" * 5000, "1.5", "", "%00",
                "\u00e9\U0001F600", "a,b,,", "x" * 5000, "true", "[1]", "{}", "' OR 1=1 --", "\"unterminated"]
QUERIES = {"/api/v1/runs": ["status", "tag", "limit", "cursor"],
           "/api/v1/runs/{run}/metrics": ["names", "rank", "start_step", "end_step", "max_points"],
           "/api/v1/runs/{run}/metrics/summary": ["limit", "cursor"],
           "/api/v1/runs/{run}/incidents": ["status", "limit", "cursor"],
           "/api/v1/runs/{run}/events": ["kinds", "limit", "cursor"],
           "/api/v1/runs/{run}/stream": ["interval"],
           "/api/v1/incidents": ["status", "limit", "cursor"], "/api/v1/clusters": ["limit", "cursor"],
           "/api/v1/search": ["q", "run_id", "limit", "cursor"], "/api/v1/baselines": []}


@attack("api/hostile-query-values")
def _(t: Target, s: Dict[str, Any]) -> Any:
    out = []
    for route, params in QUERIES.items():
        path = route.replace("{run}", s["b_run"])
        for param in params:
            for value in QUERY_VALUES:
                q = f"{param}={quote(value, safe='%')}"
                answer = _stream_or_get(t, path + "?" + q)
                out.append(answer)
            out.append(_stream_or_get(t, f"{path}?{param}=1&{param}=2"))
        out.append(_stream_or_get(t, f"{path}?unknown=1&" + "&".join(f"p{i}=1" for i in range(2000))))
    return out


def _stream_or_get(t: Target, path: str) -> Answer:
    """GET ``path``; an SSE stream answered 200 is read for a moment and closed (it never ends)."""
    conn = http.client.HTTPConnection(t.host, t.port, timeout=40)
    try:
        conn.request("GET", path, headers=auth(t, "B", "read"))
        r = conn.getresponse()
        if r.status == 200 and "event-stream" in (r.getheader("content-type") or ""):
            return r.status, b"(stream)"
        return r.status, r.read()
    finally:
        conn.close()


BODIES: List[Tuple[str, bytes]] = [
    ("nested", b'{"by": ' + b"[" * NESTED + b"]" * NESTED + b"}"),
    ("dup", b'{"by": "a", "by": "b", "text": "x"}'),
    ("nan", b'{"by": NaN, "text": Infinity}'), ("huge-number", b'{"by": 1' + b"0" * 5000 + b"}"),
    ("not-utf8", b'{"by": "\xff\xfe"}'), ("surrogate", b'{"by": "\\ud800", "text": "\\udfff"}'),
    ("unicode", json.dumps({"by": UNICODE[2], "text": "".join(UNICODE), "root_cause": UNICODE[1]}).encode()),
    ("array", b"[1, 2]"), ("null", b"null"), ("empty", b""),
    ("big", b'{"by": "a", "text": "' + b"x" * 2_000_000 + b'"}'),
    ("control", json.dumps({"by": "a\x1b[2J", "text": "\x00\n"}).encode())]


@attack("api/hostile-bodies")
def _(t: Target, s: Dict[str, Any]) -> Any:
    out = []
    inc = s["b_incident"]
    routes = [("POST", f"/api/v1/incidents/{inc}/acknowledge"), ("POST", f"/api/v1/incidents/{inc}/resolve"),
              ("POST", f"/api/v1/incidents/{inc}/notes"), ("PUT", "/api/v1/baselines/probe"),
              ("POST", "/api/v1/gate")]
    for method, path in routes:
        for _name, data in BODIES:
            for ctype in ("application/json", "text/plain"):
                out.append(request(t, method, path, data, {**auth(t, "B", "read"), "Content-Type": ctype}))
        out.append(request(t, method, path, b"{}", auth(t, "B", "ingest")))
        out.append(request(t, method, path, b"{}", {}))
    gate = [{"run_id": s["b_run"], "baseline": "x" * 10_000}, {"runs": [s["b_run"]] * 100_000},
            {"run_id": "NaN", "max_regression": float("inf")}]
    for g in gate:
        out.append(request(t, "POST", "/api/v1/gate", json.dumps(g).encode(),
                           {**auth(t, "B", "read"), "Content-Type": "application/json"}))
    for name in PATHY + UNICODE:
        out.append(request(t, "PUT", "/api/v1/baselines/" + quote(name, safe=""),
                           json.dumps({"runs": [s["b_run"]]}).encode(),
                           {**auth(t, "B", "read"), "Content-Type": "application/json"}))
    return out


@attack("grpc/hostile")
def _(t: Target, s: Dict[str, Any]) -> Any:
    import grpc

    from trainguard import wire
    out: List[Any] = []
    with grpc.insecure_channel(f"{t.host}:{t.grpc_port}") as channel:
        send = channel.unary_unary("/trainguard.v1.IngestService/Send")
        good = wire.ingest_request_from_dicts([event("g")]).SerializeToString()
        cases: List[Tuple[bytes, Tuple[Tuple[str, str], ...]]] = [
            (b"\xff" * 100, (("authorization", f"Bearer {t.token('B', 'ingest')}"),)),
            (b"\x0a" + b"\xff" * 10, (("authorization", f"Bearer {t.token('B', 'ingest')}"),)),
            (good, ()), (good, (("authorization", f"Bearer {t.token('B', 'read')}"),)),
            (good, (("authorization", "Bearer x" * 1000),)),
            (good, (("authorization", f"Bearer {t.token('B', 'ingest')}"), ("x-trainguard-sent-at", "NaN"))),
            (wire.ingest_request_from_dicts([event(s["a_run"], project="A")]).SerializeToString(),
             (("authorization", f"Bearer {t.token('B', 'ingest')}"),)),
            (wire.ingest_request_from_dicts([event(u, name=u) for u in UNICODE]).SerializeToString(),
             (("authorization", f"Bearer {t.token('B', 'ingest')}"),)),
            (b"\x0a\x00" * 1000, (("authorization", f"Bearer {t.token('B', 'ingest')}"),)),
        ]
        for message, metadata in cases:
            try:
                send(message, metadata=metadata, timeout=30)
                out.append((200, b"OK"))
            except grpc.RpcError as exc:
                code = exc.code()
                out.append((500 if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else 400,
                            f"{code.name}: {exc.details()}"[:200].encode()))
    return out


@attack("ingest/concurrent-bodies")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """Memory: 64 gzip bodies of 8 KB each inflating to 8 MiB, a 100 MB gzip bomb, 24 JSON batches of 7.9 MB,
    all at once (the in-flight bounds answer 429 / 413; RSS is printed)."""
    import gzip
    inflating = gzip.compress(b'{"events": []' + b" " * (8 * 2**20 - 100) + b"}", 9)
    bomb = gzip.compress(b" " * 100_000_000, 9)
    big = body(*[event("big", i, run_name="x" * 60_000) for i in range(130)])
    gz = {"Content-Encoding": "gzip"}
    jobs: List[Callable[[], Answer]] = [lambda: ingest(t, "B", inflating, extra=gz)] * 64
    jobs += [lambda: ingest(t, "B", bomb, extra=gz)]
    jobs += [lambda: ingest(t, "B", big)] * 24
    with ThreadPoolExecutor(len(jobs)) as pool:
        return list(pool.map(lambda job: job(), jobs))


@attack("grpc/stream-hostile")
def _(t: Target, s: Dict[str, Any]) -> Any:
    import grpc

    from trainguard import wire
    token = (("authorization", f"Bearer {t.token('B', 'ingest')}"),)
    invalid = wire.ingest_request_from_dicts([{"event_id": "", "run_id": "r"}] * 100).SerializeToString()
    good = wire.ingest_request_from_dicts([event("stream-b", i) for i in range(10)]).SerializeToString()
    out: List[Any] = []
    with grpc.insecure_channel(f"{t.host}:{t.grpc_port}") as channel:
        stream = channel.stream_unary("/trainguard.v1.IngestService/Stream")
        for messages in ([b"\xff" * 50] * 20, [invalid] * 200, [good, b"\x0a\x01", good], [good] * 300, []):
            try:
                stream(iter(messages), metadata=token, timeout=30)
                out.append((200, b"OK"))
            except grpc.RpcError as exc:
                code = exc.code()
                out.append((500 if code in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN) else 400,
                            f"{code.name}: {exc.details()}"[:200].encode()))
    return out


@attack("grpc/stalled-sends")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """Memory (H34): 4 HTTP/2 connections x 100 ``Send`` calls of B, each sending 8 MB less one byte of an
    8 MB message and then nothing, and 2 x 100 such calls without a token (sent by hand: grpc_raw.py);
    meanwhile A's ``Send`` must be accepted. Fails when the server let in more than B's and the total's
    bounds allow (64 MiB + the calls' 64 KiB windows); after the connections close, B's own ``Send`` must be
    accepted again."""
    import grpc

    from tests.services.gateway.grpc_raw import StalledCalls
    from trainguard import wire
    out: List[Answer] = []
    b_token = t.token("B", "ingest")
    opened = [StalledCalls(t.host, t.grpc_port, 100, 8_000_000, token=b_token) for _ in range(4)]
    opened += [StalledCalls(t.host, t.grpc_port, 100, 8_000_000) for _ in range(2)]
    try:
        pumps = [threading.Thread(target=c.pump, kwargs={"quiet_s": 2.0, "deadline_s": 30.0}) for c in opened]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        taken = sum(c.sent_bytes for c in opened)
        bound = 64 * 2**20 + len(opened) * 100 * 128 * 1024
        out.append((200 if taken <= bound else 500, f"server let in {taken} bytes (bound {bound})".encode()))
        unauthenticated = [code for c in opened[4:] for code in c.status.values()]
        out.append((200 if unauthenticated.count(16) == 200 else 500,
                    f"calls without a token ended {sorted(set(unauthenticated))}".encode()))
        out.append(_grpc_send(t, "A", wire, grpc))
    finally:
        for c in opened:
            c.close()
    deadline = time.monotonic() + 20
    while True:  # the closed connections' calls give their reservations back
        status, data = _grpc_send(t, "B", wire, grpc)
        if status == 200 or time.monotonic() > deadline:
            out.append((status, data))
            return out
        time.sleep(0.2)


@attack("grpc/stalled-streams")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """Memory (H36, stop 43): 2 connections x 16 ``Stream`` calls of B (``grpc_max_streams_per_token``), each
    sending 8 MB less one byte of its first message and then nothing; a Stream's next message is reserved like
    a Send's before it is read. Fails when the server let in more than B's bound allows (32 MiB + the waiting
    streams' 64 KiB windows; was 122 MiB) or A's ``Send`` is not accepted meanwhile."""
    import grpc

    from tests.services.gateway.grpc_raw import StalledCalls
    from trainguard import wire
    out: List[Answer] = []
    opened = [StalledCalls(t.host, t.grpc_port, 16, 8_000_000, method="/trainguard.v1.IngestService/Stream",
                           token=t.token("B", "ingest")) for _ in range(2)]
    try:
        for c in opened:
            c.pump(quiet_s=2.0, deadline_s=30.0)
        taken = sum(c.sent_bytes for c in opened)
        bound = 32 * 2**20 + 32 * 128 * 1024
        out.append((200 if taken <= bound else 500, f"server let in {taken} bytes (bound {bound})".encode()))
        out.append(_grpc_send(t, "A", wire, grpc))
    finally:
        for c in opened:
            c.close()
    return out


@attack("grpc/waiting-flood")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """Memory (H37, stop 43): 60 connections x 100 ``Send`` calls of B, each sending 8 MB less one byte, then
    nothing. Only 4 read at once (B's 32 MiB bound); each waiting call's stream holds its 64 KiB window, so
    the waiting ones were memory outside every bound (6,000 calls: ~400 MiB for the 5 s receive wait); now
    at most ``grpc_max_waiting_per_project`` (256) wait and the rest are refused at once. Fails when the calls
    the server has not ended still hold more than 32 MiB + 256 x 128 KiB 2 s after the last byte was sent
    (a fresh server: 46.5 MiB; 221 MiB before, RSS 369 MB), or A's ``Send`` is not accepted meanwhile."""
    import grpc

    from tests.services.gateway.grpc_raw import StalledCalls
    from trainguard import wire
    out: List[Answer] = []
    b_token = t.token("B", "ingest")
    opened = [StalledCalls(t.host, t.grpc_port, 100, 8_000_000, token=b_token) for _ in range(60)]
    try:
        pumps = [threading.Thread(target=c.pump, kwargs={"quiet_s": 1.0, "deadline_s": 30.0}) for c in opened]
        for pump in pumps:
            pump.start()
        for pump in pumps:
            pump.join()
        bound = 32 * 2**20 + 256 * 128 * 1024
        settle = time.monotonic() + 2.0  # the server ends the refused calls (well inside the receive wait)
        while (held := sum(c.held_bytes() for c in opened)) > bound and time.monotonic() < settle:
            time.sleep(0.2)
        taken = sum(c.sent_bytes for c in opened)
        out.append((200 if held <= bound else 500, f"calls not ended hold {held} bytes (bound {bound}); "
                                                   f"{taken} bytes let in, refused calls' included".encode()))
        out.append(_grpc_send(t, "A", wire, grpc))
    finally:
        for c in opened:
            c.close()
    return out


@attack("http/pipelined-stall")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """Slowloris through keep-alive + pipelining (stop 44, H40): 20 connections each send a request and, in
    the same segment, the head of a second one with a few bytes of its body (10 of them: only half its head),
    then nothing. The second request begins when the first one's response completes, with no byte arriving
    after it, so only a timer armed then can end it; 1a27038 had dropped that hook and such a connection was
    held for ever. Fails when one is not closed (408) within ``http_body_timeout_s`` (30 s) + 10 s."""
    first = b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n"
    stall_body = (f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {t.token('B', 'ingest')}\r\n"
                  "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"events\": [").encode()
    stall_head = b"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nContent-"

    def one(data: bytes) -> Answer:
        with socket.create_connection((t.host, t.port), timeout=40.0) as conn:
            conn.sendall(first + data)
            out = b""
            try:
                while True:
                    chunk = conn.recv(65536)
                    if not chunk:
                        break
                    out += chunk
            except socket.timeout:
                return 500, b"held open 40 s after its first answer: " + out[:200]
            except ConnectionResetError:
                pass
        answers = out.split(b"HTTP/1.1 ")
        last = answers[-1].split(b" ", 1)[0] if len(answers) > 2 else b""
        if last != b"408":
            return 500, b"no 408 for the stalled request: " + out[-300:]
        return 408, out[-200:]

    with ThreadPoolExecutor(20) as pool:
        return list(pool.map(one, [stall_body] * 10 + [stall_head] * 10))


SLOW_BODIES = 300  # more than project_max_http_bodies' default (256)


@attack("http/slow-bodies")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """Slow uploads of one tenant (stop 44, H43): B opens ``SLOW_BODIES`` HTTP ingest requests, each sending
    its head (``Content-Length: 100000``) and one byte of body, then trickling a byte a second, as a client
    just inside ``http_body_timeout_s`` may for ever; A ingests meanwhile. Before H43 every one was read (and
    held as long as it trickled: against an open-files limit of 1,024, 1,100 of them made the server answer
    500 to every new connection). Fails when none of B's is refused 429 (its bodies in flight not bounded),
    when a refusal lacks ``Retry-After`` or is not ``Connection: close``, or when A's ingest is not
    accepted."""
    head = (f"POST /v1/ingest HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {t.token('B', 'ingest')}\r\n"
            "Content-Type: application/json\r\nContent-Length: 100000\r\n\r\n{").encode()
    conns: List[socket.socket] = []
    answers: Dict[int, bytes] = {}
    out: List[Answer] = []
    try:
        for _ in range(SLOW_BODIES):
            conn = socket.create_connection((t.host, t.port), timeout=10)
            conn.sendall(head)
            conn.setblocking(False)
            conns.append(conn)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:  # the refusals come once each token is checked
            for k, conn in enumerate(conns):
                if k in answers:
                    continue
                try:
                    data = conn.recv(4096)  # the answer first: a trickle after a close could reset it
                except (BlockingIOError, InterruptedError):
                    try:
                        conn.send(b" ")  # still being read: one more byte, as a trickler would
                    except OSError:
                        pass
                    continue
                except OSError as exc:
                    data = repr(exc).encode()
                answers[k] = data or b"closed without an answer"
            out.append(ingest(t, "A", body(event("a-beside-slow-bodies", len(out)))))
            time.sleep(1.0)
    finally:
        for conn in conns:
            conn.close()
    refused = [a for a in answers.values() if a.startswith(b"HTTP/1.1 429")]
    other = [a for a in answers.values() if not a.startswith(b"HTTP/1.1 429")]
    bad = [a for a in refused if b"retry-after:" not in a.lower() or b"connection: close" not in a.lower()]
    a_refused = [a for a in out if a[0] != 200]
    ok = refused and not bad and not other and not a_refused
    shown = (other or bad or [a[1] for a in a_refused] or refused or [b""])[0][:200]
    why = (f"B's {SLOW_BODIES} slow bodies: {len(refused)} answered 429, {len(other)} otherwise, "
           f"{SLOW_BODIES - len(answers)} being read; A's ingest not accepted {len(a_refused)} of "
           f"{len(out)}: {shown!r}")
    out.append((429 if ok else 500, why.encode()))
    return out


@attack("grpc/bad-token-flood")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """H41 (stop 44): 300 concurrent gRPC ``Send`` callers with B's token id and a wrong secret, each sending
    again as soon as it is refused, for 6 s; A sends a ``Send`` every 0.2 s meanwhile. Fails when one of A's
    is not accepted, or a bad call is answered anything but UNAUTHENTICATED (or REFUSED_STREAM)."""
    import asyncio

    import grpc

    from trainguard import wire
    bad = t.token("B", "ingest")[:-6] + "xxxxxx"
    data = wire.ingest_request_from_dicts([event("b-bad", 1)]).SerializeToString()
    stop = threading.Event()
    codes: Dict[str, int] = {}

    async def flood() -> None:
        async with grpc.aio.insecure_channel(f"{t.host}:{t.grpc_port}") as channel:
            stub = channel.unary_unary("/trainguard.v1.IngestService/Send")

            async def one() -> None:
                while not stop.is_set():
                    try:
                        await stub(data, metadata=(("authorization", f"Bearer {bad}"),), timeout=20)
                        code = "OK"
                    except grpc.aio.AioRpcError as exc:
                        code = exc.code().name
                        if code != "UNAUTHENTICATED":
                            code += f" ({exc.details()})"[:160]
                    codes[code] = codes.get(code, 0) + 1
            await asyncio.gather(*(one() for _ in range(300)))

    runner = threading.Thread(target=lambda: asyncio.run(flood()), daemon=True)
    runner.start()
    out: List[Answer] = []
    started = time.monotonic()
    try:
        while time.monotonic() - started < 6.0:
            out.append(_grpc_send(t, "A", wire, grpc))
            time.sleep(0.2)
    finally:
        stop.set()
        runner.join(30)
    # UNAVAILABLE "RST_STREAM ... error code 7": REFUSED_STREAM, past the connection's max_concurrent_streams
    # before the client read the server's SETTINGS (retryable; nothing of it was read)
    wrong = sum(n for code, n in codes.items() if code != "UNAUTHENTICATED" and "error code 7" not in code)
    out.append((200 if not wrong else 500, f"bad-token calls: {codes}".encode()))
    return out


@attack("grpc/h2-frames")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """HTTP/2 abuse of the gRPC port below gRPC (stop 44), 4 connections each for 3 s, without a token unless
    said: a rapid reset (HEADERS of a ``Send`` with B's token, then RST_STREAM, 100 streams per write), a PING
    flood, a SETTINGS flood (50 entries a frame), a header block continued for ever (CONTINUATION frames of
    16 KB), calls with 800 KB of metadata. gRPC's core answers all of them (nothing reaches a servicer but the
    rapid reset's calls, each cancelled); A's ``Send`` after each must be accepted. The server's memory grows
    under the metadata and SETTINGS floods (glibc keeps it; security.md known items): printed, not judged."""
    import grpc

    from tests.services.gateway import grpc_raw as h2
    from trainguard import wire
    continuation = 0x9

    def block(token: str, extra: List[Tuple[str, str]]) -> bytes:
        return h2._hpack([(":method", "POST"), (":scheme", "http"),
                          (":path", "/trainguard.v1.IngestService/Send"), (":authority", "x"),
                          ("content-type", "application/grpc"), ("te", "trailers"),
                          ("authorization", f"Bearer {token}"), *extra])

    def frames(kind: str, sid: int) -> bytes:
        if kind == "rapid-reset":
            head = block(t.token("B", "ingest"), [])
            cancel = b"\x00\x00\x00\x08"
            return b"".join(h2._frame(h2.HEADERS, h2.END_HEADERS, sid + 2 * k, head)
                            + h2._frame(h2.RST_STREAM, 0, sid + 2 * k, cancel) for k in range(100))
        if kind == "ping":
            return h2._frame(h2.PING, 0, 0, b"12345678") * 500
        if kind == "settings":
            return h2._frame(h2.SETTINGS, 0, 0, b"\x00\x04\x00\x00\xff\xff" * 50) * 200
        if kind == "continuation":
            first = h2._frame(h2.HEADERS, 0, 1, block("nope", [])) if sid == 1 else b""
            return first + h2._frame(continuation, 0, 1, h2._hpack([("x-pad", "a" * 16_000)])) * 16
        whole = block("nope", [(f"x-m{k}", "v" * 8000) for k in range(100)])
        parts = [whole[i:i + 16_000] for i in range(0, len(whole), 16_000)]
        last = len(parts) - 2
        rest = (h2._frame(continuation, h2.END_HEADERS if k == last else 0, sid, p)
                for k, p in enumerate(parts[1:]))
        return h2._frame(h2.HEADERS, 0, sid, parts[0]) + b"".join(rest)

    def abuse(kind: str) -> int:
        sent = 0
        with socket.create_connection((t.host, t.grpc_port), timeout=10) as conn:
            conn.sendall(h2.PREFACE + h2._frame(h2.SETTINGS, 0, 0, b""))
            reader = threading.Thread(target=lambda: _drain(conn), daemon=True)
            reader.start()
            sid, end = 1, time.monotonic() + 3.0
            try:
                while time.monotonic() < end:
                    conn.sendall(frames(kind, sid))
                    sid += 200 if kind == "rapid-reset" else 2
                    sent += 1
            except OSError:
                pass  # the server closed it (GOAWAY): what it should do
        return sent

    out: List[Answer] = []
    for kind in ("rapid-reset", "ping", "settings", "continuation", "metadata"):
        with ThreadPoolExecutor(4) as pool:
            sent = sum(pool.map(abuse, [kind] * 4))
        status, data = _grpc_send(t, "A", wire, grpc)
        out.append((status, f"{kind}: {sent} writes, then A's Send: {bytes(data)[:120]!r}".encode()))
    return out


def _at_file_limit(t: Target, pid: int, batches: List[List[Dict[str, Any]]]) -> List[Answer]:
    """B's ``batches`` sent at once, each on its own connection, while the server's open-files limit is
    lowered (prlimit) to the descriptors it holds + 12; the limit put back after. Their answers, in order."""
    import resource

    soft, hard = resource.prlimit(pid, resource.RLIMIT_NOFILE)
    held = len(os.listdir(f"/proc/{pid}/fd"))
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (held + 12, hard))
    try:
        with ThreadPoolExecutor(len(batches)) as pool:
            return list(pool.map(lambda b: ingest(t, "B", {"events": b}), batches))
    finally:
        resource.prlimit(pid, resource.RLIMIT_NOFILE, (soft, hard))


@attack("http/open-files-burst")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """H46 (stop 45): the server's open-files limit lowered to what it holds + 12 (prlimit), then 80 of B's
    ingest requests at once, each on its own connection: a request on a thread new to the server cannot open
    that thread's projects-database reader. Each must be answered 200 or 503 + ``Retry-After`` naming too many
    open files (before: 500 ``StoreOpenError`` blaming permissions); the limit is put back, every refused
    batch is resent, and every one of B's events must be readable once. Waits 1 s first: A's incident batch
    (sent 0.1 s in) is not part of the burst."""
    pid = s["server_pid"]
    time.sleep(1.0)
    run = f"b-burst-{uuid.uuid4().hex[:6]}"
    def log_event(step: int) -> Dict[str, Any]:
        e = event(run, step, log={"logger": "burst", "level": "INFO", "message": f"b {step}"})
        del e["metrics"]
        return e

    batches = [[log_event(10 * k + i) for i in range(3)] for k in range(80)]
    first = _at_file_limit(t, pid, batches)
    out: List[Answer] = []
    for answer, batch in zip(first, batches):
        status, data = answer
        if status not in (200, 503) or (status == 503 and b"too many open files" not in data):
            out.append((500, b"burst: " + bytes(data)[:200]))  # judged a failure
        else:
            out.append(answer if status == 200 else (200, b"burst: 503 too many open files"))
        if status != 200:
            again = ingest(t, "B", {"events": batch})
            out.append(again if again[0] == 200 else (500, b"resent: " + bytes(again[1])[:200]))
    wanted = {e["event_id"] for b in batches for e in b}
    deadline, seen = time.monotonic() + 30, 0
    while time.monotonic() < deadline:
        status, data = read(t, "B", f"/api/v1/runs/{run}/events?limit=500")
        seen = len(json.loads(data).get("items", [])) if status == 200 else 0
        if seen >= len(wanted):
            break
        time.sleep(0.5)
    refused = sum(1 for status, _ in first if status != 200)
    out.append((200 if seen == len(wanted) else 500,
                f"B's events readable {seen} of {len(wanted)}; {refused} of 80 refused first".encode()))
    return out


@attack("http/open-files-metric-seeds")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """H49 (stop 45): as ``http/open-files-burst``, but the 80 batches are metrics of 80 runs the gateway has
    not seen, so each asks the metric store for the run's names (the per-run metric-name cap's seed) while
    every descriptor is held. Besides each answer being 200 or 503, the server's log must hold at most one
    line ``cannot read the metric names`` per 10 s of the burst, plus one (before: one warning with a
    traceback per run whose seed failed: 13 in a 16-24 s burst in 2 of 3 runs before H49)."""
    pid, log_path = s["server_pid"], s.get("server_log")
    time.sleep(1.0)
    start = log_path.stat().st_size if log_path else 0
    tag = uuid.uuid4().hex[:6]
    batches = [[event(f"b-seed-{tag}-{k}", i, 1.0 / (1 + i), name=f"m{i}") for i in range(3)]
               for k in range(80)]
    began = time.monotonic()
    first = _at_file_limit(t, pid, batches)
    out: List[Answer] = []
    for status, data in first:
        if status not in (200, 503) or (status == 503 and b"too many open files" not in data):
            out.append((500, b"burst: " + bytes(data)[:200]))  # judged a failure
        else:
            out.append((200, b"burst: " + bytes(data)[:60]))
    if log_path:
        with open(log_path, "rb") as f:
            f.seek(start)
            text = f.read()
        lines = text.count(b"cannot read the metric names")
        tracebacks = text.count(b"Traceback (most recent call last)")
        most = 1 + int((time.monotonic() - began) / 10)  # one line per 10 s of the burst
        out.append((200 if lines <= most else 500, f"log: {lines} metric-name seed lines (at most {most}), "
                    f"{tracebacks} tracebacks, {len(text)} bytes".encode()))
    return out


def _drain(conn: socket.socket) -> None:
    try:
        while conn.recv(1 << 20):
            pass
    except OSError:
        pass


def _grpc_send(t: Target, project: str, wire: Any, grpc: Any) -> Answer:
    request = wire.ingest_request_from_dicts([event(f"{project.lower()}-grpc", 1)])
    with grpc.insecure_channel(f"{t.host}:{t.grpc_port}") as channel:
        try:
            reply = channel.unary_unary("/trainguard.v1.IngestService/Send")(
                request.SerializeToString(), timeout=20,
                metadata=(("authorization", f"Bearer {t.token(project, 'ingest')}"),))
        except grpc.RpcError as exc:
            code = exc.code()
            status = 400 if code == grpc.StatusCode.INVALID_ARGUMENT else 503
            return status, f"{code.name}: {exc.details()}".encode()
    return 200, reply


@attack("api/unread-answers")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """B stores ~9 MB of log events, then opens 40 connections asking for a page of them and never reads the
    answers (a 4 KB receive window): the server must not keep 40 pages (RSS printed); A's reads go on."""
    for k in range(8):
        events = []
        for i in range(20):
            e = event("fat", k * 20 + i, log={"logger": "x", "level": "INFO", "message": "y" * 60_000,
                                              "source": "logging"})
            del e["metrics"]
            events.append(e)
        ingest(t, "B", body(*events))
    time.sleep(3)
    out: List[Answer] = []
    conns = []
    try:
        for _ in range(40):
            conn = socket.socket()
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            conn.connect((t.host, t.port))
            conn.sendall(f"GET /api/v1/runs/fat/events?limit=500 HTTP/1.1\r\nHost: x\r\nAuthorization: "
                         f"Bearer {t.token('B', 'read')}\r\n\r\n".encode())
            conns.append(conn)
        time.sleep(2)
        out.append(read(t, "A", "/api/v1/runs"))
    finally:
        for conn in conns:
            conn.close()
    return out


@attack("state/evicted-run-memory")
def _(t: Target, s: Dict[str, Any]) -> Any:
    """H48: B's flood of distinct run ids must not make the pipeline forget A's evicted, finished run. On a
    server of its own with small bounds (ended runs evicted at the next tick, 50 runs a project, 200 evicted
    runs remembered, no new-run rate limit) so that the flood takes seconds: A's run raises and exits 1,
    is evicted, B sends 1,000 one-event runs, then A's exception is delivered again (at-least-once) with a
    NaN. Fails when A's run record is no longer ``failed`` or A's run has more incidents than before."""
    overrides = {"project_max_runs": 50, "evicted_runs_remembered": 200, "ended_run_ttl_s": 0}
    with tempfile.TemporaryDirectory(prefix="hostile-probe-evicted-") as tmp:
        proc, own = spawn(Path(tmp), {"TRAINGUARD_DETECTION_OVERRIDES": json.dumps(overrides),
                                      "TRAINGUARD_PROJECT_NEW_RUNS_PER_S": "0"})
        try:
            return _evicted_run_memory(own)
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _evicted_run_memory(t: Target) -> List[Answer]:
    run = "a-finished"
    crash = event(run, 6, exception={"type": "ValueError", "message": "bad batch", "handled": False,
                                     "frames": [{"filename": "/job/loader.py", "function": "load",
                                                 "lineno": 3, "in_app": True}]})
    del crash["metrics"]
    done = event(run, 7, lifecycle={"phase": "EXIT", "exit_code": 1})
    del done["metrics"]
    answers = [ingest(t, "A", {"events": [event(run, i, 2.0 - 0.1 * i) for i in range(6)] + [crash]})]
    answers.append(ingest(t, "A", {"events": [done]}))

    def state() -> Tuple[str, int]:
        status, data = read(t, "A", f"/api/v1/runs/{run}")
        kind = json.loads(data).get("status", "?") if status == 200 else f"HTTP {status}"
        status, data = read(t, "A", f"/api/v1/runs/{run}/incidents")
        return kind, len(json.loads(data).get("items", [])) if status == 200 else -1

    def settled(marker_project: str, marker_run: str) -> None:
        """Wait until an event sent after everything else is stored (the processor took what came before)."""
        answers.append(ingest(t, marker_project, {"events": [event(marker_run, 0)]}))
        deadline = time.monotonic() + 30
        while read(t, marker_project, f"/api/v1/runs/{marker_run}")[0] != 200 and time.monotonic() < deadline:
            time.sleep(0.2)

    deadline = time.monotonic() + 30
    while state()[0] != "failed" and time.monotonic() < deadline:
        time.sleep(0.2)
    before = state()
    time.sleep(2.5)  # two ticks: the ended run is evicted
    for chunk in range(4):
        answers.append(ingest(t, "B", {"events": [event(f"flood-{chunk}-{i}", 0) for i in range(250)]}))
    settled("B", "flood-marker")
    answers.append(ingest(t, "A", {"events": [crash, event(run, 8, "NaN")]}))
    settled("A", "a-marker")
    after = state()
    if before[0] != "failed" or after != before:
        answers.append((599, f"A's evicted run changed: {before} -> {after} after B's flood".encode()))
    return answers


# ------------------------------------------------------------------------------------------ the checks

def setup(t: Target) -> Dict[str, Any]:
    """A's and B's runs, each with a NaN-loss incident; their ids."""
    s: Dict[str, Any] = {"a_run": "a-run", "b_run": "b-run", "victim_ids": []}
    for project, run in (("A", s["a_run"]), ("B", s["b_run"])):
        events = [event(run, i, 2.0 - 0.1 * i) for i in range(6)] + [event(run, 6, "NaN")]
        status, data = ingest(t, project, {"events": events})
        assert status == 200 and json.loads(data)["accepted"] == 7, data
        s[f"{project.lower()}_event"] = events[0]["event_id"]
        deadline = time.monotonic() + 30
        while True:
            status, data = read(t, project, f"/api/v1/runs/{run}/incidents")
            items = json.loads(data).get("items", []) if status == 200 else []
            if items:
                s[f"{project.lower()}_incident"] = items[0]["incident_id"]
                break
            assert time.monotonic() < deadline, f"no incident for {project}'s NaN loss"
            time.sleep(0.2)
    return s


def victim(t: Target, s: Dict[str, Any]) -> Optional[str]:
    """A sends one log event (read back by id at the end); None when accepted, else why not."""
    e = event(s["a_run"], 100 + len(s["victim_ids"]), log={"logger": "victim", "level": "INFO",
                                                           "message": "still here", "source": "logging"})
    del e["metrics"]
    if s.get("claimed"):  # an id B sent first (tenant/event-id-claim)
        e["event_id"] = s.pop("claimed")
    try:
        status, data = ingest(t, "A", {"events": [e]})
    except OSError as exc:
        return f"victim: {exc!r}"
    if status != 200 or json.loads(data).get("accepted") != 1:
        return f"victim: {status} {data[:200]!r}"
    s["victim_ids"].append(e["event_id"])
    return None


def victim_incident(t: Target, s: Dict[str, Any], started: float, box: Dict[str, Any]) -> None:
    """While an attack runs: A logs a NaN loss to a fresh run (0.1 s after the attack began) and polls its
    incidents; ``box['incident_s']``: seconds from A's send to the incident (None: not within the bound)."""
    time.sleep(max(0.0, started + 0.1 - time.monotonic()))
    run = f"victim-{uuid.uuid4().hex[:8]}"
    events = [event(run, i, 2.0 - 0.1 * i) for i in range(6)] + [event(run, 6, "NaN")]
    sent = time.monotonic()
    try:
        status, data = ingest(t, "A", {"events": events})
    except OSError as exc:
        box["incident_why"] = f"A's NaN batch: {exc!r}"
        return
    if status != 200:
        box["incident_why"] = f"A's NaN batch: {status} {data[:200]!r}"
        return
    while time.monotonic() - sent < box["bound_s"]:
        status, data = read(t, "A", f"/api/v1/runs/{run}/incidents")
        if status == 200 and json.loads(data).get("items"):
            box["incident_s"] = time.monotonic() - sent
            return
        time.sleep(0.05)
    box["incident_why"] = f"A's NaN-loss incident not open within {box['bound_s']:g} s"


def judge(name: str, answers: Any, s: Dict[str, Any]) -> List[str]:
    problems = []
    for status, data in answers if isinstance(answers, list) else [answers]:
        if status >= 500 or status < 0 or (status == 0 and not _closing_is_an_answer(data)):
            problems.append(f"{status} {bytes(data)[:200]!r}")
    if name == "tenant/cross-project":
        for k, (status, data) in enumerate(s["cross"][1:], start=1):
            if k != s["b_same_name"] and status != 404:
                problems.append(f"B reached A's thing: {status} {bytes(data)[:200]!r}")
        first = json.loads(s["cross"][0][1])
        if first.get("accepted") != 0 or first["rejected"][0]["code"] != "wrong_project":
            problems.append(f"B wrote as A: {first}")
    return problems


def _closing_is_an_answer(data: bytes) -> bool:
    """A request no HTTP server must read (a 100 KB request line or header) may be answered by a reset."""
    return len(data) < 400 and (b"aaaa" in data or b"xxxx" in data or (b"GET /api" in data and b"%" in data))


def final_check(t: Target, s: Dict[str, Any]) -> List[str]:
    """Every event A sent is readable with A's token; A's incident is still open and A's alone."""
    problems = []
    deadline = time.monotonic() + 30
    missing = list(s["victim_ids"])
    while missing and time.monotonic() < deadline:  # the processor stores them asynchronously
        missing = [i for i in missing if read(t, "A", f"/api/v1/runs/{s['a_run']}/events/{i}")[0] != 200]
        if missing:
            time.sleep(0.5)
    if missing:
        problems.append(f"{len(missing)} of A's {len(s['victim_ids'])} events not readable (lost?)")
    status, data = read(t, "A", f"/api/v1/incidents/{s['a_incident']}")
    if status != 200 or json.loads(data).get("status") != "open":
        problems.append(f"A's incident: {status} {data[:200]!r}")  # B tried to acknowledge / resolve it
    status, data = read(t, "A", f"/api/v1/runs/{s['a_run']}/metrics?names=loss&start_step=99&end_step=99")
    if status != 200 or any(any(ranks.values()) for ranks in json.loads(data)["series"].values()):
        problems.append(f"B's same-named run reached A's: {status} {data[:200]!r}")
    return problems


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default="", help="run only attacks whose name starts with this")
    ap.add_argument("--timeout", type=float, default=60.0, help="seconds an attack may take")
    ap.add_argument("--show", action="store_true", help="print every answer (status and its first bytes)")
    ap.add_argument("--incident-bound-s", type=float, default=10.0,
                    help="A's NaN-loss incident, sent during an attack, must open within this many seconds")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="hostile-probe-") as tmp:
        proc, t = spawn(Path(tmp))
        try:
            s = setup(t)
            s["server_pid"] = proc.pid
            s["server_log"] = Path(tmp) / "serve.log"
            failed = 0
            for name, fn in ATTACKS:
                if args.only and not name.startswith(args.only):
                    continue
                started = time.monotonic()
                box: Dict[str, Any] = {}
                runner = threading.Thread(target=_run_into, args=(box, fn, t, s), daemon=True)
                runner.start()
                probe: Dict[str, Any] = {"bound_s": args.incident_bound_s}
                watcher = threading.Thread(target=victim_incident, args=(t, s, started, probe), daemon=True)
                watcher.start()
                runner.join(args.timeout)
                took = time.monotonic() - started
                watcher.join(args.incident_bound_s + 5)
                if runner.is_alive():
                    problems = [f"no answer within {args.timeout:g} s"]
                elif "a" not in box:
                    problems = ["the attack itself raised (see the traceback above)"]
                else:
                    problems = judge(name, box["a"], s)
                why = victim(t, s)
                if why:
                    problems.append(why)
                if "incident_why" in probe:
                    problems.append(probe["incident_why"])
                incident = f"{probe['incident_s']:.2f} s" if "incident_s" in probe else "-"
                s.setdefault("incident_s", []).append(probe.get("incident_s"))
                ready = request(t, "GET", "/readyz", timeout=10)[0]
                if ready != 200:
                    problems.append(f"/readyz {ready}")
                counts: Dict[int, int] = {}
                for status, _ in box.get("a", []) if isinstance(box.get("a"), list) else []:
                    counts[status] = counts.get(status, 0) + 1
                shown = ", ".join(f"{k}x{v}" for k, v in sorted(counts.items()))
                mark = "FAIL" if problems else "ok  "
                rss = _rss_mb(proc.pid)
                print(f"{mark} {name:28} {took:6.1f} s  A's incident {incident:>7}  RSS {rss:5d} MB  {shown}",
                      flush=True)
                for problem in problems[:8]:
                    print(f"       {problem}", flush=True)
                if args.show and isinstance(box.get("a"), list):
                    for status, data in box["a"]:
                        print(f"       {status} {bytes(data)[:160]!r}")
                for took_s, what in SLOW:
                    print(f"       slow ({took_s:.1f} s): {what}", flush=True)
                SLOW.clear()
                failed += bool(problems)
            problems = final_check(t, s)
            for problem in problems:
                print(f"FAIL final: {problem}")
            verdict = "passed" if not problems else "FAILED"
            print(f"{failed} attack(s) failed; final check {verdict} (A's {len(s['victim_ids'])} events "
                  f"readable, its incident open, its run untouched); server RSS {_rss_mb(proc.pid)} MB")
            return 1 if failed or problems else 0
        finally:
            proc.terminate()
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()


def _run_into(box: Dict[str, Any], fn: Attack, t: Target, s: Dict[str, Any]) -> None:
    box["a"] = fn(t, s)


def _rss_mb(pid: int) -> int:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS"):
                return int(line.split()[1]) // 1024
    except OSError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
