"""Local replicas behind smg, as child processes: what the replica benchmark and its test run.

    with LocalCluster(log_dir) as cluster:
        a = cluster.start_replica(port=8001, num_threads=1, num_slots=5120)
        b = cluster.start_replica(port=8002, num_threads=1, num_slots=5120)
        gateway = cluster.start_smg([a.url, b.url], port=8000, policy="cache_aware")
        ...                                       # load gateway.url; cluster.kill(b) mid-run
    # every process is stopped on exit: SIGINT, then SIGKILL after a grace period

Everything binds 127.0.0.1. Readiness is polled with a deadline, so a process that dies or
never comes up fails the start with its log's tail instead of hanging.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import httpx

READY_TIMEOUT_S = 180.0  # a replica loads its model first: minutes on a busy 2-core machine
STOP_GRACE_S = 10.0


def wait_until_healthy(
    popen: subprocess.Popen[Any], base: str, timeout_s: float = READY_TIMEOUT_S
) -> None:
    """Return once `base`/health answers 200 (a `radixlm serve` child started by a benchmark);
    RuntimeError if the process exits first or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            raise RuntimeError(f"radixlm serve exited with {popen.returncode}")
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass  # not listening yet
        time.sleep(0.5)
    raise RuntimeError(f"radixlm serve did not answer in {timeout_s:g} s")


@dataclass
class Process:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def log_tail(self, num_chars: int = 2000) -> str:
        return self.log.read_text(errors="replace")[-num_chars:] if self.log.exists() else ""


def smg_executable() -> str | None:
    """The smg launcher of this environment (next to the interpreter) or on PATH; None if absent."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.exists() else shutil.which("smg")


class LocalCluster:
    """Starts radixlm replicas and smg as children of this process; stops them all on exit."""

    def __init__(self, log_dir: Path, model: str | None = None, api_key: str | None = None):
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.model = model
        self.api_key = api_key
        self.processes: list[Process] = []

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop_all()

    def start_replica(
        self, port: int, num_threads: int, num_slots: int, *extra: str, worker_id: str | None = None
    ) -> Process:
        """`radixlm serve` on 127.0.0.1:port, ready (its /health answers) when this returns."""
        return self.start_replicas([port], num_threads, num_slots, *extra, worker_ids=[worker_id])[
            0
        ]

    def start_replicas(
        self,
        ports: Sequence[int],
        num_threads: int,
        num_slots: int,
        *extra: str,
        worker_ids: Sequence[str | None] = (),
    ) -> list[Process]:
        """One replica per port, loading side by side; all ready when this returns."""
        started = []
        for i, port in enumerate(ports):
            argv = [
                sys.executable, "-m", "radixlm", "serve", "--host", "127.0.0.1",
                "--port", str(port), "--num-threads", str(num_threads),
                "--num-slots", str(num_slots), "--log-level", "warning", *extra,
            ]  # fmt: skip
            if self.model:
                argv += ["--model", self.model]
            if self.api_key:
                argv += ["--api-key", self.api_key]
            if i < len(worker_ids) and worker_ids[i]:
                argv += ["--worker-id", str(worker_ids[i])]
            started.append(self._spawn(f"replica-{port}", f"http://127.0.0.1:{port}", argv))
        for process in started:
            self._wait(process, lambda c, p=process: c.get(f"{p.url}/health").status_code == 200)
        return started

    def start_smg(
        self,
        worker_urls: Sequence[str],
        port: int,
        policy: str = "cache_aware",
        *extra: str,
        metrics_port: int | None = None,
    ) -> Process:
        """smg in front of `worker_urls`, ready when it lists every one of them as healthy; its
        Prometheus metrics on `metrics_port` (default: port + 1000)."""
        smg = smg_executable()
        if smg is None:
            raise RuntimeError("smg is not installed (pip install smg)")
        argv = [
            smg, "launch", "--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", *worker_urls, "--policy", policy, "--worker-wedge-secs", "30",
            "--prometheus-host", "127.0.0.1",
            "--prometheus-port", str(metrics_port or port + 1000),
            "--log-level", "warn", *extra,
        ]  # fmt: skip
        if self.api_key:
            argv += ["--api-key", self.api_key]
        process = self._spawn(f"smg-{port}", f"http://127.0.0.1:{port}", argv)

        def ready(client: httpx.Client) -> bool:
            workers = client.get(f"{process.url}/workers", headers=self._headers()).json()
            healthy = [w for w in workers.get("workers", []) if w.get("is_healthy")]
            return len(healthy) == len(worker_urls)

        self._wait(process, ready)
        return process

    def kill(self, process: Process) -> None:
        """SIGKILL: a replica dying mid-run, with no chance to finish anything."""
        process.popen.kill()
        process.popen.wait(timeout=STOP_GRACE_S)

    def stop(self, *processes: Process) -> None:
        """Ctrl-C to each, then SIGKILL to any still there after the grace period."""
        running = [p for p in processes if p.popen.poll() is None]
        for process in running:
            process.popen.send_signal(signal.SIGINT)
        deadline = time.monotonic() + STOP_GRACE_S
        for process in running:
            try:
                process.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.popen.kill()
                process.popen.wait(timeout=STOP_GRACE_S)

    def stop_all(self) -> None:
        """Stop every process started here, side by side."""
        self.stop(*self.processes)
        self.processes.clear()

    def flush(self, urls: Sequence[str]) -> None:
        """Empty each replica's prefix cache (POST /flush_cache)."""
        with httpx.Client(timeout=60.0, headers=self._headers()) as client:
            for url in urls:
                client.post(f"{url}/flush_cache").raise_for_status()

    # ---- helpers ----------------------------------------------------------------------------
    def _headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def _spawn(self, name: str, url: str, argv: list[str]) -> Process:
        log = self.log_dir / f"{name}.log"
        with open(log, "wb") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
        process = Process(name, url, popen, log)
        self.processes.append(process)
        return process

    def _wait(self, process: Process, ready: Any) -> None:
        deadline = time.monotonic() + READY_TIMEOUT_S
        with httpx.Client(timeout=5.0) as client:
            while time.monotonic() < deadline:
                if process.popen.poll() is not None:
                    raise RuntimeError(f"{process.name} exited:\n{process.log_tail()}")
                try:
                    if ready(client):
                        return
                except (httpx.HTTPError, ValueError):
                    pass  # not listening yet
                time.sleep(0.2)
        raise RuntimeError(
            f"{process.name} not ready in {READY_TIMEOUT_S} s:\n{process.log_tail()}"
        )
