"""gRPC ``Send`` calls waiting for room in the bounds on ingest bytes in flight (security.md H34), and the
blocking work of many calls of one project beside another project's (stop 43).

Before stop 43: a waiting Send looked again every 50 ms (1,000 waiting Sends cost 14-35 % of a core); a
give-back woke the oldest waiter only, which did not pass the wake on when it could not take the room (its
project at its bound) although a waiter of another project could; an HTTP give-back woke nobody; and the
gRPC workers' one FIFO queue put a quiet project's message behind every queued message of a noisy one
(black-box, ``bench/grpc_waiters.py``: 1,000 concurrent Sends of one project took the other project's ack
latency p50 from ~50 ms to 1.9-2.2 s).

Each test drives the servicer of a real ``build_grpc_server`` on its own event loop; none asserts a duration:
"granted at once" means within a few turns of the loop, where a 50 ms poll has not come round."""

from __future__ import annotations

import asyncio
import threading
import time
from concurrent import futures
from typing import Any, Callable, Iterator, List, Tuple

import pytest

from tests.services.gateway.helpers import new_gateway
from trainguard_server.gateway.grpc import build_grpc_server

MiB = 2**20


@pytest.fixture
def served() -> Iterator[Tuple[Any, Any]]:
    """A project may hold 2 MiB, the server 3 MiB, a Send reserves 1 MiB (max_batch_bytes); 1 worker."""
    gateway, _queue, _tokens = new_gateway(max_batch_bytes=MiB, max_event_bytes=MiB // 2,
                                           ingest_max_inflight_bytes=3 * MiB, project_max_inflight_bytes=2 * MiB,
                                           grpc_receive_wait_s=60.0)
    server, _port = build_grpc_server(gateway, "127.0.0.1", 0, MiB, workers=1)
    server.start()
    try:
        yield gateway, server
    finally:
        server.stop(None).wait(10)


def _on_loop(server: Any, coro: Any) -> futures.Future[Any]:
    return asyncio.run_coroutine_threadsafe(coro, server._loop)


def _turns(server: Any, n: int = 50) -> None:
    """Let the server's loop run ``n`` turns (no clock: a 50 ms poll does not come round in them)."""
    async def spin() -> None:
        for _ in range(n):
            await asyncio.sleep(0)

    server._call(spin())


def _reserve(server: Any, project: str) -> futures.Future[Any]:
    call = _on_loop(server, server.servicer._reserve(project))
    _turns(server)
    return call


def _end(server: Any, gateway: Any, calls: List[futures.Future[Any]]) -> None:
    for call in calls:
        call.cancel()
    _turns(server)


def test_a_give_back_a_waiting_send_of_a_full_project_cannot_take_goes_to_another_projects_waiter(
        served: Any) -> None:
    gateway, server = served
    counts = gateway.body_bytes
    assert counts.take("A", 2 * MiB) is None and counts.take("B", MiB) is None  # A at its bound, total full
    first = _reserve(server, "A")  # the oldest waiter: its project's bound refuses it
    second = _reserve(server, "B")  # the total (and B's share of it) refuses it
    assert not first.done() and not second.done()
    server._loop.call_soon_threadsafe(server.servicer._give_back, "B", MiB)  # a B message decoded
    _turns(server)
    assert second.done() and second.result() == MiB  # granted at once (was: at its next 50 ms look)
    assert not first.done()
    _end(server, gateway, [first])
    assert counts.held("A") == 2 * MiB and counts.held("B") == MiB


def test_an_http_give_back_grants_a_waiting_send_its_room(served: Any) -> None:
    gateway, server = served
    counts = gateway.body_bytes
    assert counts.take("A", 2 * MiB) is None and counts.take("B", MiB) is None
    waiting = _reserve(server, "B")
    assert not waiting.done()
    counts.give_back("A", MiB)  # an HTTP body of A answered (HTTP's thread; not the gRPC servicer's)
    _turns(server)
    assert waiting.done() and waiting.result() == MiB  # was: at its next 50 ms look


def test_waiting_sends_do_not_poll(served: Any) -> None:
    gateway, server = served
    counts = gateway.body_bytes
    takes = [0]
    take = counts.take

    def counted(project: str, n: int, own: int = 0) -> Any:
        takes[0] += 1
        return take(project, n, own)

    counts.take = counted
    assert counts.take("A", 2 * MiB) is None  # A at its bound
    calls = [_on_loop(server, server.servicer._reserve("A")) for _ in range(200)]
    _turns(server)
    time.sleep(0.5)  # long enough for every waiter to have looked 10 times at 20 Hz
    _turns(server)
    assert takes[0] <= 1 + 2 * 200, takes[0]  # each waiter tried once or twice when it came (was: ~2,000+)
    assert not any(call.done() for call in calls)
    counts.give_back("A", 2 * MiB)  # room for two: the two oldest get it, the others still wait
    _turns(server)
    granted = [i for i, call in enumerate(calls) if call.done()]
    assert granted == [0, 1] and counts.held("A") == 2 * MiB
    _end(server, gateway, calls[2:])
    counts.give_back("A", 2 * MiB)
    assert counts.held() == 0


def test_a_quiet_projects_message_is_not_queued_behind_a_noisy_projects_messages(served: Any) -> None:
    _gateway, server = served  # one worker
    ran: List[str] = []
    release = threading.Event()

    def job(name: str, block: bool = False) -> Callable[[], None]:
        def run() -> None:
            if block:
                release.wait(30)
            ran.append(name)
        return run

    calls = [_on_loop(server, server.servicer._holding("A", 0, job("A0", block=True)))]
    _turns(server)
    calls += [_on_loop(server, server.servicer._holding("A", 0, job(f"A{i}"))) for i in range(1, 30)]
    _turns(server)
    calls.append(_on_loop(server, server.servicer._holding("B", 0, job("B"))))
    _turns(server)
    release.set()
    for call in calls:
        call.result(30)
    assert len(ran) == 31
    assert ran.index("B") <= 2, ran  # its turn comes after one more of A's (was: after all 29)


def test_a_project_runs_at_most_its_share_of_the_workers_and_another_project_gets_one() -> None:
    """``grpc_workers_per_project`` (here 2 of 4 threads): the noisy project's fifth job waits though threads
    are free, so its jobs share the GIL with fewer of its own (before stop 43 all threads ran its jobs)."""
    from trainguard_server.gateway.grpc import _FairWork

    release = threading.Event()
    started: List[str] = []

    def job(name: str) -> Callable[[], None]:
        def run() -> None:
            started.append(name)
            release.wait(30)
        return run

    with futures.ThreadPoolExecutor(4) as pool:
        work = _FairWork(pool, 4, per_key=2)
        jobs = [work.submit("A", job(f"A{i}")) for i in range(5)]
        jobs.append(work.submit("B", job("B")))
        deadline = time.monotonic() + 30
        while len(started) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sorted(started) == ["A0", "A1", "B"], started
        release.set()
        for j in jobs:
            j.result(30)
    assert len(started) == 6


def test_past_max_waiting_per_project_a_send_is_refused_at_once_and_given_up_waiters_leave_the_queue(
        served: Any) -> None:
    """Each waiting call's stream holds up to its 64 KiB HTTP/2 window: 100 connections x 100 Sends of one token
    held 197 MiB (RSS 80 -> 297 MB) before stop 43, outside every bound (security.md H37)."""
    import dataclasses

    from trainguard_server.gateway.ingest import Backpressure

    gateway, server = served
    counts = gateway.body_bytes
    servicer = server.servicer
    servicer.limits = dataclasses.replace(servicer.limits, max_waiting_per_project=3, receive_wait_s=0.2)
    assert counts.take("A", 2 * MiB) is None  # A at its bound
    calls = [_reserve(server, "A") for _ in range(3)]
    refused = _reserve(server, "A")
    assert refused.done(), "the fourth waiting Send of A was not refused at once"
    with pytest.raises(Backpressure, match="TRAINGUARD_GRPC_MAX_WAITING_PER_PROJECT"):
        refused.result()
    other = _reserve(server, "B")  # another project is not counted with A
    assert other.done() and other.result() == MiB
    for call in calls:  # the receive wait (0.2 s) ends them; they leave the queue
        with pytest.raises(Backpressure, match="TRAINGUARD_GRPC_RECEIVE_WAIT_S"):
            call.result(30)
    _turns(server)
    assert ("A", False) not in servicer._waiting
    again = [_reserve(server, "A") for _ in range(3)]  # room for three waiting again
    assert not any(call.done() for call in again)
    _end(server, gateway, again)


def test_waiters_that_give_up_one_at_a_time_leave_one_turn_per_project(served: Any) -> None:
    """A project at its bound whose Sends give up one at a time (client cancels, short deadlines), each
    followed by a new one: its queue is dropped with each give-up, and before the fix every new waiter added
    ANOTHER turn that the next grants kept re-queueing (hR, stop 43: 3,000 give-ups -> 3,000 turns; one
    grant with one live waiter then cost 5.5 ms, on every give-back of every project) -- one tenant made
    every tenant's gRPC ingest pay for its abandoned calls. Now a project has at most one turn."""
    gateway, server = served
    servicer = server.servicer
    assert gateway.body_bytes.take("A", 2 * MiB) is None  # A at its bound
    for _ in range(40):
        call = _reserve(server, "A")
        assert not call.done()
        _end(server, gateway, [call])
    live = _reserve(server, "A")
    other = _reserve(server, "B")  # a give-back of another project runs the grants
    assert other.done() and other.result() == MiB
    assert len(servicer._turns) <= 1 and list(servicer._turns) == [("A", False)]
    _end(server, gateway, [live])


def test_streams_waiting_for_their_next_message_leave_their_project_room_for_a_send(served: Any) -> None:
    """A live ``Stream`` holds its next message's reservation while its client is idle (H36). With the
    project's bound holding 2 reservations, 2 idle Streams took both: the project's Sends waited for a Stream's
    next message and its HTTP bodies were answered 429 (hR, stop 43). The Streams' share is the bound less one
    reservation."""
    gateway, server = served
    counts = gateway.body_bytes
    first = _on_loop(server, server.servicer._reserve("A", 60.0, stream=True))
    _turns(server)
    assert first.done() and first.result() == MiB
    second = _on_loop(server, server.servicer._reserve("A", 60.0, stream=True))
    _turns(server)
    assert not second.done()  # past the Streams' share (2 MiB - 1 MiB), though the bound has room
    send = _reserve(server, "A")
    assert send.done() and send.result() == MiB  # the Send finds the room
    assert counts.fits("A", MiB) is not None  # the project is at its bound now: an HTTP body would wait
    counts.give_back("A", MiB)  # the Send's message decoded
    _turns(server)
    assert not second.done()  # still the Streams' share
    server._loop.call_soon_threadsafe(server.servicer._stream_release, "A", MiB)  # the first's message came
    counts.give_back("A", MiB)
    _turns(server)
    assert second.done() and second.result() == MiB
    server._loop.call_soon_threadsafe(server.servicer._stream_release, "A", MiB)
    counts.give_back("A", MiB)
    _turns(server)
    assert counts.held() == 0 and not server.servicer._stream_reserved


class _Context:
    """The part of a grpc.aio call context ``_authenticate`` reads."""

    def __init__(self, token: str) -> None:
        self.metadata = (("authorization", f"Bearer {token}"),)

    def invocation_metadata(self) -> Any:
        return self.metadata


def test_a_flood_of_bad_tokens_does_not_delay_another_tenants_authentication(served: Any) -> None:
    """hR (stop 43): every call's authentication shared one FIFO turn, so one tenant's many calls with a
    wrong secret (or made-up tokens) queued ahead of a quiet tenant's: its token was checked after all of
    them (black-box: 1,000 such Sends took the quiet project's ack p90 from ~15 to ~500 ms). A token that
    passed before is now checked in its project's turn; unknown tokens share one turn."""
    gateway, server = served  # one worker
    checked: List[str] = []
    authenticate = gateway.authenticate

    def spy(token: Any) -> Any:
        checked.append(token)
        return authenticate(token)

    gateway.authenticate = spy
    good = _new_token(gateway)
    _on_loop(server, server.servicer._authenticate(_Context(good))).result(30)  # passes once: remembered
    release = threading.Event()
    blocker = server.servicer.work.submit("X", lambda: release.wait(30))  # the one worker busy
    bad = good[:-6] + "xxxxxx"  # a known token id, a wrong secret
    calls = [_on_loop(server, server.servicer._authenticate(_Context(bad))) for _ in range(30)]
    _turns(server)
    calls.append(_on_loop(server, server.servicer._authenticate(_Context(good))))
    _turns(server)
    release.set()
    blocker.result(30)
    assert calls[-1].result(30).project  # the quiet tenant passes
    for call in calls[:-1]:
        with pytest.raises(Exception, match="invalid or revoked token"):
            call.result(30)
    order = checked[1:]
    assert len(order) == 31
    assert order.index(good) <= 2, order.index(good)  # its turn comes after one more bad one (was: 31st)


def _new_token(gateway: Any) -> str:
    """An ingest token of the gateway's project store (a fresh one: the store hashes what it gives out)."""
    return str(gateway.projects.create_token("quiet", "ingest"))
