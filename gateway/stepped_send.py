"""Calling uvicorn's ASGI ``send`` without awaiting it: the one place the gateway relies on how
uvicorn behaves inside, isolated here (uvicorn is pinned in requirements.txt).

What it relies on (uvicorn 0.54, httptools protocol): ``send`` is a coroutine that writes the
message to the transport and returns at its first step, without suspending, unless the
transport is write-paused (the user reads slower than the variant writes); then it suspends
until the transport drains. So the gateway's forwarder steps the coroutine once, in the
upstream read callback, and only a suspended one is finished in a task
(gateway/forwarder.py). tests/gateway/test_stepped_send.py fails if uvicorn stops behaving so:
then the forwarder must await ``send`` in the request's task (one loop turn more per chunk).
"""

from __future__ import annotations

from typing import Any

from gateway.http import Send


def step(send: Send, message: dict) -> tuple[Any, Any] | None:
    """Start ``send(message)``: None when it completed at once; else (the coroutine, what it
    waits on), to be finished by ``resume``. Raises what ``send`` raised (a refused message)."""
    coro = send(message)
    try:
        awaiting = coro.send(None)
    except StopIteration:
        return None
    return coro, awaiting


async def resume(coro: Any, awaiting: Any) -> None:
    """Run a coroutine that was stepped by hand and suspended on ``awaiting``, to its end.

    What a coroutine yields when it suspends is an asyncio future flagged "a task is blocking on
    me" (``_asyncio_future_blocking``); a task clears the flag when it takes the future, and
    awaiting a future still flagged fails ("await wasn't used with future"). No task took this
    one (the step was by hand), so the flag is cleared here, as the task would have."""
    while True:
        if getattr(awaiting, "_asyncio_future_blocking", False):
            awaiting._asyncio_future_blocking = False
        await awaiting
        try:
            awaiting = coro.send(None)
        except StopIteration:
            return
