"""``GET /api/v1/runs/{run}/metrics?names=`` names any legal metric name (security.md H35). A metric name may
hold commas and spaces at its ends (H31), but ``names`` was split on every comma and each name stripped: such
a metric could not be asked for (``names=a,b`` asked for ``a`` and ``b``; the dashboard, which joins names with
commas, drew nothing for it). Now a backslash before a comma, a space or a backslash makes that character part
of the name; every other ``names`` value reads as before (any other backslash is itself, so the SDK's escaped
names, ``loss\\x1b[2J``, are named as stored). Against ``trainguard serve`` (EmbeddedServer on 127.0.0.1)."""

from __future__ import annotations

from typing import Dict, List

import pytest

from tests.services.gateway.embedded_server import LiveServer, event, module_live_server

live = module_live_server()
NAMES = ["a,b", "a", "b", " x", "x", "y ", "y", "c\\", "loss\\x1b[2J", "loss", "lr", "p, q", "z\u00a0", "z",
         "\u3000w", "w"]


@pytest.fixture(scope="module")
def run(live: LiveServer) -> str:
    points = [{"name": name, "value": float(k)} for k, name in enumerate(NAMES)]
    r = live.post_events([event("names", step, metrics={"points": points}) for step in range(3)])
    assert r.json()["accepted"] == 3, r.text
    live.wait_for(lambda: len(live.get("/api/v1/runs/names/metrics").json().get("series", {})) == len(NAMES))
    return "names"


def _asked(live: LiveServer, run: str, names: str) -> Dict[str, float]:
    r = live.get(f"/api/v1/runs/{run}/metrics", names=names)
    assert r.status_code == 200, r.text
    return {name: ranks["0"][0]["last"] for name, ranks in r.json()["series"].items() if ranks}


@pytest.mark.parametrize(("names", "wanted"), [
    ("a\\,b", ["a,b"]),                       # was a and b
    ("a\\,b,a", ["a,b", "a"]),
    ("\\ x,y\\ ", [" x", "y "]),              # was x and y
    ("p\\, q", ["p, q"]),
    ("c\\\\", ["c\\"]),
    ("c\\", ["c\\"]),                         # a backslash before nothing it escapes is itself
    ("loss\\x1b[2J", ["loss\\x1b[2J"]),       # the SDK's escaped name, as before
    ("loss, lr", ["loss", "lr"]),             # unchanged
    (" x , y ", ["x", "y"]),                  # unchanged: unescaped edge spaces are stripped
    ("z\\\u00a0", ["z\u00a0"]),                # stop 43: was the name z\\ (the backslash kept, the NBSP stripped): nothing
    ("\\\u3000w,z\u00a0", ["\u3000w", "z"]),    # an ideographic space escaped; an unescaped NBSP stripped
])
def test_names_selects_any_legal_metric_name(live: LiveServer, run: str, names: str, wanted: List[str]) -> None:
    got = _asked(live, run, names)
    assert got == {name: float(NAMES.index(name)) for name in wanted}, got


def test_the_list_syntax() -> None:
    from trainguard_server.api.routes.runs import metric_name_list
    assert metric_name_list("a\\,b, c ,,\\ d\\ ") == ["a,b", "c", " d "]
    assert metric_name_list("\\\\\\,") == ["\\,"] and metric_name_list(",") == [] and metric_name_list(" ") == []
    assert metric_name_list("a\\b") == ["a\\b"] and metric_name_list("a\\") == ["a\\"]
    assert metric_name_list("\\\u00a0a\\\u2003,\\\t") == ["\u00a0a\u2003", "\t"]  # any white space (stop 43)
