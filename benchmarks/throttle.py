"""A read path of bounded rate: a TCP proxy on loopback that passes what a
server sends at most ``rate`` bytes per second, all connections together (one
shared link), and what clients send unchanged. The store benchmark puts it
in front of Redis to measure time to first token where reads bound it."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

PIECE = 64 * 1024  # bytes forwarded at a time


class ThrottledProxy:
    """``with ThrottledProxy(port, rate) as proxy:`` forwards ``proxy.port`` to ``port`` on loopback."""

    def __init__(self, target_port: int, rate: float) -> None:
        self.target_port, self.rate = target_port, float(rate)
        self._free_at = 0.0  # when the shared link is next free
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._run, name="throttled-proxy", daemon=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]

    def __enter__(self) -> ThrottledProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the throttled proxy did not start")
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", self.port))
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)
        await asyncio.gather(self._pump(client_r, server_w, throttle=False), self._pump(server_r, client_w))

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, *, throttle: bool = True) -> None:
        try:
            while data := await src.read(PIECE):
                if throttle:  # wait for the link: each piece takes len / rate seconds of it
                    now = time.monotonic()
                    self._free_at = max(now, self._free_at) + len(data) / self.rate
                    await asyncio.sleep(self._free_at - now)
                dst.write(data)
                await dst.drain()
        except (ConnectionError, asyncio.CancelledError):
            pass
        finally:
            dst.close()
