"""security.md H50: one project's many metric names must not make the gateway forget another project's runs.

:class:`MetricNameCap` remembers the metric names of runs up to a memory budget
(``TRAINGUARD_METRIC_NAMES_MEMORY_BYTES``); beyond it the least recently active run of *any* project was
forgotten, and a forgotten run is read again from the metric store on its next request (on the request
path, under the tenant's latency). Project A sending new runs of many names -- within its per-run cap --
therefore made project B's runs be read again from the store request after request (and, while the store
cannot answer, counted from zero). Now the project whose remembered names weigh the most forgets its own
least recently active run first."""

from __future__ import annotations

from typing import List, Tuple

from trainguard_server.gateway.metric_names import NAME_OVERHEAD, MetricNameCap

ONE = 2 + NAME_OVERHEAD  # what one two-character name weighs


def counting_cap(budget_names: int) -> Tuple[MetricNameCap, List[Tuple[str, str]]]:
    asked: List[Tuple[str, str]] = []

    def seed(project: str, run_id: str) -> List[str]:
        asked.append((project, run_id))
        return []

    return MetricNameCap(cap=1000, budget=budget_names * ONE, seed=seed), asked


def names(prefix: str, n: int) -> List[str]:
    return [f"{prefix}{i}" for i in range(n)]


def test_a_flood_of_another_projects_names_does_not_forget_b_s_runs() -> None:
    cap, asked = counting_cap(budget_names=100)
    for run in ("b1", "b2"):
        assert cap.refusals("B", [(0, run, ["l1", "l2", "l3"])]) == {}
    for k in range(200):  # 200 new runs of A, 10 names each: 20x the budget
        assert cap.refusals("A", [(0, f"a{k}", [f"{chr(97 + i)}{k % 10}" for i in range(10)])]) == {}
    assert cap.names("B", "b1") == 3 and cap.names("B", "b2") == 3  # before: 0, both forgotten
    for run in ("b1", "b2"):
        assert cap.refusals("B", [(1, run, ["l1", "l2", "l3"])]) == {}
    assert [a for a in asked if a[0] == "B"] == [("B", "b1"), ("B", "b2")]  # before: each read again
    assert cap._tracked <= 100 * ONE  # the budget still holds


def test_the_heaviest_project_forgets_its_own_least_recently_active_run() -> None:
    cap, _ = counting_cap(budget_names=10)
    assert cap.refusals("A", [(0, "a-old", ["x1", "x2", "x3"])]) == {}
    assert cap.refusals("B", [(0, "b", ["y1", "y2"])]) == {}
    assert cap.refusals("A", [(0, "a-new", ["z1", "z2", "z3", "z4"])]) == {}
    assert cap.refusals("A", [(0, "a-old", ["x1"])]) == {}  # a-old is A's most recently active now
    assert cap.refusals("A", [(0, "a-3", ["w1", "w2"])]) == {}  # 11 names > 10: A forgets a-new
    assert (cap.names("A", "a-new"), cap.names("A", "a-old"), cap.names("B", "b")) == (0, 3, 2)


def test_when_b_holds_the_most_b_pays() -> None:
    cap, _ = counting_cap(budget_names=10)
    assert cap.refusals("B", [(0, "b-old", names("p", 4))]) == {}
    assert cap.refusals("B", [(0, "b-new", names("q", 4))]) == {}
    assert cap.refusals("A", [(0, "a", names("r", 3))]) == {}  # 11 > 10: B (8) forgets b-old
    assert (cap.names("B", "b-old"), cap.names("B", "b-new"), cap.names("A", "a")) == (0, 4, 3)


def test_the_run_being_admitted_is_never_the_one_forgotten() -> None:
    cap, _ = counting_cap(budget_names=4)
    assert cap.refusals("B", [(0, "b", names("p", 2))]) == {}
    assert cap.refusals("A", [(0, "a", names("r", 6))]) == {}  # A's one run alone is over budget: B goes
    assert (cap.names("A", "a"), cap.names("B", "b")) == (6, 0)


def test_a_request_without_metrics_of_a_project_with_no_run_remembered_is_admitted() -> None:
    cap, _ = counting_cap(budget_names=4)
    assert cap.admits_known("C", {}) is True  # 15a0270b raised KeyError here: every such ingest answered 500
    assert cap.admits_known("C", {"c": {"x"}}) is False
