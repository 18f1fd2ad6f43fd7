"""A real blend server (``python -m blend_integrations.serve``) on loopback,
for the tests and the fuzz run: start it, wait until it answers, stop it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from .redis_server import free_port


class BlendServer:
    """One server process logging to ``log``; ``args`` are more launcher or
    ``vllm serve`` options, ``env`` more environment variables."""

    def __init__(self, model: str, *, store: str | Path, log: str | Path, args: list[str] = (),
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = Path(log)
        self.cmd = [sys.executable, "-m", "blend_integrations.serve", str(model), "--store", str(store),
                    "--host", "127.0.0.1", "--port", str(self.port), *args]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 600) -> "BlendServer":
        with open(self.log, "w") as log:
            self.proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        deadline = time.time() + timeout_s
        while not self.healthy():
            if self.proc.poll() is not None or time.time() > deadline:
                self.stop()
                raise RuntimeError(f"the blend server did not start; see {self.log}")
            time.sleep(2)
        return self

    def healthy(self) -> bool:
        """The process runs and ``GET /health`` answers 200 (it answers 500
        once vLLM's engine core has died)."""
        if self.proc is None or self.proc.poll() is not None:
            return False
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                return r.status == 200
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> "BlendServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
