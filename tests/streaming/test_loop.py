"""The event loop requests are streamed on (streaming/loop.py): uvloop by default, asyncio's on
request, and a name that is neither refused."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from streaming import loop


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_the_default_loop_is_uvloop():
    assert loop.run(_loop_type()) is uvloop.Loop


def test_asyncio_keeps_asyncios_own_loop():
    assert issubclass(loop.run(_loop_type(), "asyncio"), asyncio.SelectorEventLoop)


def test_an_unknown_loop_is_refused_with_the_choices_named():
    with pytest.raises(ValueError, match=r"event loop 'trio': use one of uvloop, asyncio"):
        loop.loop_factory("trio")
