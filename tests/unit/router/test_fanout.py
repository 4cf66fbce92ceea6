"""all_or_first_error and merge_streams: results in order, every stream's items in its
order, and the first error (or the caller leaving) stops every other task or stream."""

import asyncio

import pytest

from router.fanout import all_or_first_error, close_all, merge_streams


class Log:
    """How each scripted stream / task ended: "done", "failed", "cancelled" (a cancel
    reached it inside a pending await) or "closed" (aclose() at a yield)."""

    def __init__(self):
        self.ended: dict[str, str] = {}

    async def stream(self, name, items, fail=None, hang=False):
        """Yields items (a sleep(0) before each), then raises `fail` or waits forever."""
        how = "closed"
        try:
            for item in items:
                await asyncio.sleep(0)
                yield item
            if fail is not None:
                raise fail
            if hang:
                await asyncio.Event().wait()
            how = "done"
        except asyncio.CancelledError:
            how = "cancelled"
            raise
        except Exception:
            how = "failed"
            raise
        finally:
            self.ended[name] = how

    async def task(self, name, result, fail=None, hang=False):
        try:
            await asyncio.sleep(0)
            if fail is not None:
                raise fail
            if hang:
                await asyncio.Event().wait()
            self.ended[name] = "done"
            return result
        except asyncio.CancelledError:
            self.ended[name] = "cancelled"
            raise


def test_all_results_in_order():
    log = Log()
    got = asyncio.run(all_or_first_error([log.task(i, i * 10) for i in range(4)]))
    assert got == [0, 10, 20, 30]
    assert log.ended == dict.fromkeys(range(4), "done")


def test_one_failure_cancels_the_others_and_is_raised():
    log = Log()
    tasks = [log.task(0, 0, hang=True), log.task(1, 1, fail=KeyError("k")), log.task(2, 2)]
    with pytest.raises(KeyError):
        asyncio.run(all_or_first_error(tasks))
    assert log.ended == {0: "cancelled", 2: "done"}


def test_cancelling_the_caller_cancels_every_task():
    log = Log()

    async def go():
        waiting = asyncio.ensure_future(
            all_or_first_error([log.task(i, i, hang=True) for i in range(3)])
        )
        await asyncio.sleep(0.01)
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting

    asyncio.run(go())
    assert log.ended == dict.fromkeys(range(3), "cancelled")


def collect(streams):
    async def go():
        return [x async for x in merge_streams(streams)]

    return asyncio.run(go())


@pytest.mark.parametrize("n", [1, 2, 5])
def test_merge_keeps_every_item_and_each_streams_order(n):
    log = Log()
    got = collect([log.stream(i, [(i, k) for k in range(i + 2)]) for i in range(n)])
    assert sorted(got) == [(i, (i, k)) for i in range(n) for k in range(i + 2)]
    for i in range(n):
        assert [item for index, item in got if index == i] == [(i, k) for k in range(i + 2)]
    assert log.ended == dict.fromkeys(range(n), "done")


def test_a_failing_stream_stops_the_others_and_ends_the_merge_with_its_error():
    log = Log()
    streams = [log.stream(0, [1], hang=True), log.stream(1, [2, 3], fail=KeyError("k"))]
    seen = []

    async def go():
        async for item in merge_streams(streams):
            seen.append(item)

    with pytest.raises(KeyError):
        asyncio.run(go())
    assert sorted(seen) == [(0, 1), (1, 2), (1, 3)]
    assert log.ended == {0: "cancelled", 1: "failed"}


@pytest.mark.parametrize("n, how", [(1, "closed"), (3, "cancelled")])
def test_closing_the_merge_stops_every_stream(n, how):
    log = Log()

    async def go():
        merged = merge_streams([log.stream(i, [i, i], hang=True) for i in range(n)])
        assert (await anext(merged))[1] in range(n)
        await merged.aclose()  # what a client that leaves does to the response

    asyncio.run(go())
    # n > 1: each stream's pump is always inside its anext, where the cancel lands
    assert log.ended == dict.fromkeys(range(n), how)


def test_cancelling_the_merge_stops_every_stream():
    log = Log()

    async def go():
        async def consume():
            async for _ in merge_streams([log.stream(i, [i], hang=True) for i in range(3)]):
                pass

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(go())
    assert log.ended == dict.fromkeys(range(3), "cancelled")


def test_close_all_closes_suspended_streams_and_leaves_finished_ones():
    log = Log()

    async def go():
        a, b = log.stream("a", [1, 2]), log.stream("b", [])
        await anext(a)
        assert [x async for x in b] == []
        await close_all([a, b])

    asyncio.run(go())
    assert log.ended == {"a": "closed", "b": "done"}
