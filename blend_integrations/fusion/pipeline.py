"""Walk layer: layer-wise loading pipelined with the walk.

The walk computes every token in the layers before the first check layer and
needs the stored KV of layer l only when it reaches layer l. A background
thread therefore reads the stored chunks layer-major (layer 0 of every chunk,
then layer 1, ...) while the walk computes, and the walk waits for a chunk's
layer only when it needs it (``ReusedSpan.ready``). The checksum of an entry
covers all of it, so it is known good only after its last layer: the caller
settles every reader after the walk and redoes the walk if one failed.
"""

from __future__ import annotations

import threading
import time

from ..store.layered import LayerReader


class LoadFailed(Exception):
    """A chunk the walk was waiting for could not be read: stop the walk."""


class LayerLoader:
    """Reads ``readers`` in ``threads`` background threads while the caller computes.

    Use as a context manager around the walk: it starts the threads, and on
    exit stops them (early, if the walk failed) and waits for them. Each
    thread reads its share of the readers (every ``threads``-th), layer-major.
    ``errors`` maps a reader to what reading it raised; ``waited_s`` is how
    long the walk waited for KV (not compute time).
    """

    def __init__(self, readers: list[LayerReader], threads: int = 1) -> None:
        self.readers = readers
        self.errors: dict[LayerReader, BaseException] = {}
        self.waited_s = 0.0
        self._cond = threading.Condition()
        self._stop = False
        self._running = 0
        shares = [readers[i :: max(1, threads)] for i in range(max(1, min(threads, len(readers))))]
        self._threads = [
            threading.Thread(target=self._run, args=(share,), name="blend-layer-loader", daemon=True)
            for share in shares
        ]

    def ready(self, reader: LayerReader):
        """The ``ReusedSpan.ready`` callback for one reader's KV."""

        def ready(layer: int) -> None:
            with self._cond:
                started = time.perf_counter()
                while reader not in self.errors and reader.layers_read <= layer and self._running:
                    self._cond.wait()
                self.waited_s += time.perf_counter() - started
                if reader in self.errors or reader.layers_read <= layer:
                    why = self.errors.get(reader, "the loader stopped")
                    raise LoadFailed(f"chunk {reader.key[:16]}... could not be read: {why}")

        return ready

    def _run(self, readers: list[LayerReader]) -> None:
        try:
            self._read_all(readers)
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    def _read_all(self, readers: list[LayerReader]) -> None:
        layers = max((r.num_layers for r in readers), default=0)
        for _ in range(layers):
            for reader in readers:
                if self._stop:
                    return
                if reader in self.errors or reader.layers_read == reader.num_layers:
                    continue
                try:
                    reader.read_layer()
                except Exception as e:  # any failure of one chunk fails that chunk only
                    with self._cond:
                        self.errors[reader] = e
                with self._cond:
                    self._cond.notify_all()
        for reader in readers:
            if reader not in self.errors and not self._stop:
                try:
                    reader.verify()
                except Exception as e:
                    with self._cond:
                        self.errors[reader] = e

    def __enter__(self) -> LayerLoader:
        if self.readers:
            self._running = len(self._threads)
            for thread in self._threads:
                thread.start()
        return self

    def __exit__(self, exc_type, *exc) -> None:
        if exc_type is not None and exc_type is not LoadFailed:
            self._stop = True  # the walk failed for another reason: stop reading
        for thread in self._threads:
            if thread.is_alive():
                thread.join()
