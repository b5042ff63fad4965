"""Start a real server on a free localhost port: uvicorn in a thread over a tiny model directory (`serve`),
or `prescient serve` in its own process (`serve_process`), driven through HTTP (the official `openai`
client, httpx). No part of the model or runtime is mocked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn
from openai import OpenAI

from offload_runtime.server import create_app

MODEL = "tiny"
ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(condition: Callable[[], bool], seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def healthy(url: str, **httpx_args) -> bool:
    try:
        return httpx.get(f"{url}/health", **httpx_args).status_code == 200
    except httpx.TransportError:
        return False


@contextmanager
def serve_process(model_dir, port: int, *flags: str, env: dict[str, str] | None = None, ready_s: float = 120,
                  graceful_s: float = 0, **httpx_args) -> Iterator[subprocess.Popen]:
    """`prescient serve` as its console script runs it, at `port`, ready (its /health answers 200
    through `httpx_args`, within `ready_s`); afterwards, if still running, sent SIGTERM and given
    `graceful_s` seconds to stop (what a Ray cluster it started needs), then killed. Output: `proc.stdout`."""
    scheme = "https" if "--ssl-certfile" in flags else "http"
    proc = subprocess.Popen([sys.executable, "-m", "cli.main", "serve", "--model", str(model_dir), "--port", str(port),
                             "--served-model-name", MODEL, "--threads", "1", *flags],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})
    try:
        wait_until(lambda: healthy(f"{scheme}://127.0.0.1:{port}", **httpx_args) or proc.poll() is not None, ready_s)
        assert proc.poll() is None, proc.stdout.read()
        yield proc
    finally:
        if proc.poll() is None and graceful_s:
            proc.terminate()
            try:
                proc.wait(graceful_s)
            except subprocess.TimeoutExpired:
                pass
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    app: object
    api_key: str = "unused"  # what `client` sends

    @property
    def client(self) -> OpenAI:
        return self.client_with(self.api_key)

    def client_with(self, api_key: str) -> OpenAI:
        return OpenAI(base_url=f"{self.url}/v1", api_key=api_key, max_retries=0, timeout=60)

    def metrics(self) -> dict[str, float]:
        """Every sample of /metrics by name and labels, e.g. 'prescient_requests_total{...}'."""
        out = {}
        for line in httpx.get(f"{self.url}/metrics").text.splitlines():
            if line and not line.startswith("#"):
                name, value = line.rsplit(" ", 1)
                out[name] = float(value)
        return out

    def metric(self, name: str, **labels: str) -> float:
        """The sum of `name`'s samples whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total


@contextmanager
def serve(model_dir, **options) -> Iterator[Running]:
    """Start `create_app(model_dir, **options)` under uvicorn in a thread; wait for /health; stop
    it (and its runtime threads) afterwards. With `api_keys`, the client sends the first."""
    options.setdefault("served_model_name", MODEL)
    app = create_app(model_dir, **options)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                           timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if app.state.service.load_error is not None:
                raise app.state.service.load_error
            assert time.monotonic() < deadline, "the server did not become ready"
            time.sleep(0.05)
        yield Running(url, app, *options.get("api_keys", ())[:1])
    finally:
        server.should_exit = True
        thread.join(30)
        assert not thread.is_alive(), "the server did not stop"
