"""admission.py: the per-model queue in priority order, its bound, its deadline, slots passed on
(on a virtual clock: the times are the test's numbers, the waits real futures)."""

from __future__ import annotations

import asyncio

import pytest

from vsup.proxy.admission import EXPIRED, FULL, SHED, Admission, Limit
from vsup.proxy.backends import Backend

A, B = Backend("0", "http://a", "chat"), Backend("1", "http://b", "chat")


def setup(limit: int = 1, reserve: int = 0, queue_max: int = 8, timeout: float = 10.0, top: int = 0, backends=(A,)):
    in_flight: dict[str, int] = {}
    lim = Limit(limit, reserve, queue_max, timeout)
    adm = Admission(in_flight, lambda b: lim, top)
    return adm, in_flight, lim, (lambda: tuple(backends))


async def enter(adm, in_flight, ready, lim, priority=0, now=0.0, key=""):
    """admit() and, like the forwarder, count the request in flight on the first instance given."""
    got = await adm.admit("chat", ready, priority, now, lim, key)
    if isinstance(got, tuple) and got:
        in_flight[got[0].name] = in_flight.get(got[0].name, 0) + 1
    return got


def done(adm, in_flight, backend=A):
    in_flight[backend.name] -= 1
    adm.release(backend)


async def settle():
    for _ in range(5):
        await asyncio.sleep(0)


async def test_room_then_queue_in_priority_order_fifo_within():
    adm, fl, lim, ready = setup()
    assert await enter(adm, fl, ready, lim) == (A,)  # room: no wait
    order = []

    async def waiter(tag, priority):
        got = await enter(adm, fl, ready, lim, priority)
        order.append(tag)
        return got

    tasks = [asyncio.create_task(waiter(tag, p)) for tag, p in (("low1", 0), ("low2", 0), ("high", 5), ("low3", 0))]
    await settle()
    assert adm.lengths() == {("chat", 0): 3, ("chat", 5): 1}
    for _ in range(4):
        done(adm, fl)
        await settle()
    assert order == ["high", "low1", "low2", "low3"]
    assert all(t.result() == (A,) for t in tasks)
    assert adm.waiting == 0 and not adm.reserved


async def test_bound_refuses_and_higher_priority_sheds_the_newest_lowest():
    adm, fl, lim, ready = setup(queue_max=2)
    await enter(adm, fl, ready, lim)
    first = asyncio.create_task(enter(adm, fl, ready, lim, 0))
    second = asyncio.create_task(enter(adm, fl, ready, lim, 0))
    await settle()
    assert await enter(adm, fl, ready, lim, 0) == FULL  # same priority: no place
    high = asyncio.create_task(enter(adm, fl, ready, lim, 3))
    await settle()
    assert second.done() and second.result() == SHED  # the newest of the lowest made room
    assert not first.done()
    done(adm, fl)
    await settle()
    assert high.result() == (A,) and not first.done()
    done(adm, fl)
    await settle()
    assert first.result() == (A,)


async def test_deadline_expires_only_the_old_waits():
    adm, fl, lim, ready = setup(timeout=10.0)
    await enter(adm, fl, ready, lim)
    old = asyncio.create_task(adm.admit("chat", ready, 0, 0.0, lim))
    young = asyncio.create_task(adm.admit("chat", ready, 0, 5.0, lim))
    await settle()
    assert adm.expire(9.9) == 0
    assert adm.oldest(9.9) == {"chat": pytest.approx(9.9)}
    assert adm.expire(10.0) == 1
    await settle()
    assert old.result() == EXPIRED and not young.done()
    assert adm.expire(15.0) == 1
    await settle()
    assert young.result() == EXPIRED and adm.waiting == 0


async def test_a_cancelled_waiter_leaves_at_once_and_a_granted_slot_goes_on():
    adm, fl, lim, ready = setup()
    await enter(adm, fl, ready, lim)
    gone = asyncio.create_task(enter(adm, fl, ready, lim))
    other = asyncio.create_task(enter(adm, fl, ready, lim))
    await settle()
    gone.cancel()
    await settle()
    assert adm.waiting == 1  # left at once, not at its deadline
    # a slot granted to a waiter that is cancelled before it runs goes on to the next one
    third = asyncio.create_task(enter(adm, fl, ready, lim))
    await settle()
    done(adm, fl)  # granted to `other`...
    other.cancel()  # ...which is cancelled before it runs
    await settle()
    assert third.result() == (A,) and fl["0"] == 1 and not adm.reserved


async def test_a_granted_slot_is_not_taken_by_a_newcomer():
    adm, fl, lim, ready = setup()
    await enter(adm, fl, ready, lim)
    queued = asyncio.create_task(enter(adm, fl, ready, lim))
    await settle()
    done(adm, fl)  # granted to `queued`, which has not run yet
    newcomer = asyncio.create_task(enter(adm, fl, ready, lim))
    await settle()
    assert queued.result() == (A,) and not newcomer.done()
    newcomer.cancel()


async def test_reserved_slots_are_the_top_prioritys_only():
    adm, fl, lim, ready = setup(limit=2, reserve=1, top=10)
    assert await enter(adm, fl, ready, lim, 0) == (A,)
    batch = asyncio.create_task(enter(adm, fl, ready, lim, 0))  # the last slot is reserved: it waits
    await settle()
    assert not batch.done()
    assert await enter(adm, fl, ready, lim, 10) == (A,)  # the top priority takes it at once
    done(adm, fl)
    await settle()
    assert not batch.done()  # 1 in flight of 2, one reserved: still no room for priority 0
    done(adm, fl)
    await settle()
    assert batch.result() == (A,)


async def test_poke_grants_an_instance_that_joined():
    backends = [A]
    adm, fl, lim, _ = setup()
    ready = lambda: tuple(backends)  # noqa: E731
    await enter(adm, fl, ready, lim)
    waiting = asyncio.create_task(enter(adm, fl, ready, lim))
    await settle()
    backends.append(B)
    adm.poke()
    await settle()
    assert waiting.result()[0] == B


async def test_no_limit_and_nothing_ready():
    adm = Admission({}, lambda b: None)
    lim = Limit(1)
    assert await adm.admit("chat", lambda: (A, B), 0, 0.0, lim) == (A, B)
    assert await adm.admit("chat", lambda: (), 0, 0.0, lim) == ()


async def test_a_queue_of_one_shed_for_a_higher_priority_serves_it():
    adm, fl, lim, ready = setup(queue_max=1)
    await enter(adm, fl, ready, lim)
    low = asyncio.create_task(enter(adm, fl, ready, lim, 0))
    await settle()
    high = asyncio.create_task(enter(adm, fl, ready, lim, 3))
    await settle()
    assert low.result() == SHED and adm.lengths() == {("chat", 3): 1}
    done(adm, fl)
    await settle()
    assert high.result() == (A,)


async def test_keys_of_one_priority_take_turns_and_share_a_full_queue():
    adm, fl, lim, ready = setup(queue_max=4)
    await enter(adm, fl, ready, lim, key="hog")
    order = []

    async def waiter(tag, key, priority=0):
        got = await enter(adm, fl, ready, lim, priority, key=key)
        if got != SHED:
            order.append(tag)
        return got

    hog = [asyncio.create_task(waiter(f"hog{i}", "hog")) for i in range(4)]
    await settle()
    assert adm.waiting == 4  # alone, a key may use the whole queue...
    assert await enter(adm, fl, ready, lim, key="hog") == FULL
    other = [asyncio.create_task(waiter(f"web{i}", "web")) for i in range(2)]
    await settle()
    # ...but another key takes places from it, the newest first, while it holds more than one more
    assert [t.result() for t in hog[2:]] == [SHED, SHED] and not any(t.done() for t in hog[:2] + other)
    assert await enter(adm, fl, ready, lim, key="web") == FULL  # 2 and 2: even
    for _ in range(4):
        done(adm, fl)
        await settle()
    assert order == ["hog0", "web0", "hog1", "web1"]  # turns, not first come first served
    low = asyncio.create_task(waiter("low", "web", -1))
    await settle()
    assert not low.done()
    done(adm, fl)
    await settle()
    assert order[-1] == "low"
