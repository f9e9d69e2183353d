"""A client that hangs up before its response starts cancels the request's handler.

An ASGI server tells an application that its client went away only through ``receive()``
(an ``http.disconnect`` message); it does not cancel the handler. A streamed response
listens for that itself, but a non-streamed completion answers only when the last token
is made: without this, a client that gives up (its own timeout, Ctrl-C) leaves the engine,
or the router's replica, generating for nobody until the end. vLLM's API server does the
same per route (``with_cancellation``); here it is one middleware for every POST.

Once the handler has read the request body, a watcher waits on ``receive()``: a disconnect
before the response starts cancels the handler (the engine request is aborted where its
stream is closed; the router closes its replica connection). When the response starts the
watcher stops, and a streamed response listens for the disconnect on its own."""

from __future__ import annotations

import asyncio

from starlette.types import ASGIApp, Message, Receive, Scope, Send


class CancelOnDisconnect:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "POST":
            await self.app(scope, receive, send)
            return
        body_read = asyncio.Event()
        gone = asyncio.Event()
        started = False

        async def receive_body() -> Message:
            message = await receive()
            if message["type"] == "http.disconnect":
                gone.set()
            elif not message.get("more_body", False):
                body_read.set()
            return message

        async def send_response(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                watcher.cancel()  # (the response's own disconnect listener takes over)
            await send(message)

        async def watch() -> None:
            await body_read.wait()
            while (await receive())["type"] != "http.disconnect":
                pass  # (nothing else arrives once the body is read)
            gone.set()

        handler = asyncio.ensure_future(self.app(scope, receive_body, send_response))
        watcher = asyncio.ensure_future(watch())
        hung_up = asyncio.ensure_future(gone.wait())
        try:
            await asyncio.wait({handler, hung_up}, return_when=asyncio.FIRST_COMPLETED)
            if not handler.done() and not started:
                handler.cancel()  # nobody will read the answer
            await asyncio.wait({handler})
            if not handler.cancelled():
                handler.result()  # (an error of the handler's goes on as without this)
        finally:
            watcher.cancel()
            hung_up.cancel()
            if not handler.done():
                handler.cancel()
