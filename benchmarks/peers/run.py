"""Run the comparison: each engine in turn, alone, through the same client and workloads.

    .venv/bin/python benchmarks/peers/run.py [--engines NAME ...] [--workloads NAME ...]
                                             [--isa native|avx2]
    .venv/bin/python benchmarks/peers/report.py          # table + plots from the results

For a server engine: start it on 127.0.0.1 (its output in $PEERS_CACHE/logs/), wait until it
answers, warm it up with two short requests, run `python -m radixlm bench serve` once per
workload, stop it (by its own process group). The transformers floor runs hf_offline.py per
workload. Each (engine, workload) result lands in results/runs/<engine>__<workload>.json with the
commands, the versions and the CPU contention seen during the run: the cores that processes
other than the engine and the client kept busy (from /proc/stat against their own CPU time).
`--isa avx2` caps every engine to AVX2 + FMA (engines.ISA_CAPS: environment variables, and
llama.cpp's AVX2-only build) and writes to results/runs-avx2/ instead; `--workloads served` is
issue 13's served run (engines.SERVED).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from engines import (
    CACHE,
    CONCURRENCY,
    ENGINES,
    HERE,
    ISA_CAPS,
    QUICK,
    REPO_PY,
    SERVED,
    WORKLOADS,
    Engine,
    versions,
    with_isa,
)

sys.path.insert(0, str(HERE.parent.parent))
from radixlm.bench.host import describe_host

RUNS = HERE / "results" / "runs"
CLK_TCK = os.sysconf("SC_CLK_TCK")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", choices=sorted(ENGINES), default=list(ENGINES))
    parser.add_argument(
        "--workloads", nargs="+", choices=[*WORKLOADS, *SERVED], default=list(WORKLOADS)
    )
    parser.add_argument(
        "--isa",
        choices=list(ISA_CAPS),
        default="native",
        help="cap every engine's instruction set (default: what the CPU has)",
    )
    parser.add_argument("--out", type=Path, default=None, help="default: results/runs[-ISA]")
    parser.add_argument("--quick", action="store_true", help="tiny workloads: check the setup")
    args = parser.parse_args()
    if args.out is None:
        args.out = RUNS if args.isa == "native" else RUNS.with_name(f"runs-{args.isa}")
    if args.quick:
        for name, params in QUICK.items():
            WORKLOADS[name] = {**WORKLOADS[name], **params}
    # a SIGTERM (timeout, kill) unwinds through run_server's `finally`, which stops the engine
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    (CACHE / "logs").mkdir(parents=True, exist_ok=True)
    found = versions()
    for name in args.engines:
        engine = with_isa(ENGINES[name], args.isa)
        if engine.port:
            run_server(engine, args.workloads, args.out, found)
        else:
            for workload in args.workloads:
                cmd = [*engine.command, *_workload_flags(workload), "--json", "{out}"]
                _measure(engine, workload, cmd, [], args.out, found)


def run_server(engine: Engine, workloads: list[str], out: Path, found: dict[str, str]) -> None:
    log = open(CACHE / "logs" / f"{_slug(engine.name)}.log", "w")  # noqa: SIM115
    server = subprocess.Popen(
        engine.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **engine.env},
    )  # fmt: skip
    try:
        _wait_ready(engine, server)
        base = f"http://127.0.0.1:{engine.port}"
        warm = [str(REPO_PY), "-m", "radixlm", "bench", "serve", "--base-url", base,
                "--workload", "random", "--param", "num_requests=2", "--param", "prompt_len=64",
                "--param", "output_len=4", "--seed", "99",
                "--extra-body", engine.extra_body]  # fmt: skip
        subprocess.run(warm, check=True, capture_output=True)
        for workload in workloads:
            cmd = [str(REPO_PY), "-m", "radixlm", "bench", "serve", "--base-url", base,
                   *_workload_flags(workload), "--extra-body", engine.extra_body,
                   "--json", "{out}"]  # fmt: skip
            _measure(engine, workload, cmd, [server.pid], out, found)
    finally:
        _stop(server)
        log.close()


def _measure(
    engine: Engine, workload: str, cmd: list[str], pids: list[int], out: Path, found: dict[str, str]
) -> None:
    """Run one client command (or offline script) and save its JSON with the contention."""
    path = out / f"{_slug(engine.name)}__{workload}.json"
    cmd = [c.replace("{out}", str(path)) for c in cmd]
    print(f"== {engine.name} / {workload}: {' '.join(cmd)}", flush=True)
    load_before, top_before = os.getloadavg()[0], _top()
    busy0, ours0, children0 = _cpu_busy(), _tree_cpu(pids), _children_cpu()
    t0 = time.monotonic()
    client = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    output, _ = client.communicate()
    wall = time.monotonic() - t0
    busy = _cpu_busy() - busy0
    # the finished client is gone from /proc: its CPU time is in our reaped children's
    ours = _tree_cpu(pids) - ours0 + _children_cpu() - children0
    print(output[-1500:], flush=True)
    if client.returncode != 0:
        print(f"!! {engine.name} / {workload} failed ({client.returncode})", file=sys.stderr)
        return
    result = json.loads(path.read_text())
    result["engine"] = {
        "name": engine.name,
        "label": engine.label,
        "command": _portable(" ".join(engine.command)),
        "env": {k: _portable(v) for k, v in engine.env.items()},
        "client_command": _portable(" ".join(cmd)),
        "versions": found,
        "isa": engine.isa,
    }
    result["host"] = describe_host()
    result["contention"] = {
        "other_busy_cores": max(0.0, (busy - ours) / wall),
        "engine_and_client_cores": ours / wall,
        "loadavg_1m_before": load_before,
        "loadavg_1m_after": os.getloadavg()[0],
        "wall_s": wall,
        "top_before": top_before,
    }
    path.write_text(json.dumps(result, indent=2))
    print(
        f"   contention: {result['contention']['other_busy_cores']:.2f} other cores busy",
        flush=True,
    )


def _workload_flags(workload: str) -> list[str]:
    client_workload, params = SERVED.get(workload, (workload, WORKLOADS.get(workload, {})))
    flags = ["--workload", client_workload, "--concurrency", str(CONCURRENCY), "--seed", "0"]
    for key, value in params.items():
        flags += ["--param", f"{key}={value}"]
    return flags


def _wait_ready(engine: Engine, server: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + engine.startup_s
    url = f"http://127.0.0.1:{engine.port}{engine.ready_path}"
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"{engine.name} exited ({server.returncode}); see its log")
        with contextlib.suppress(OSError), urllib.request.urlopen(url, timeout=2) as response:
            if response.status == 200:  # (OSError: not listening yet)
                return
        time.sleep(1.0)
    raise RuntimeError(f"{engine.name} did not answer {url} in {engine.startup_s:.0f} s")


def _stop(server: subprocess.Popen[bytes]) -> None:
    """End the server we started and everything it spawned (its own process group)."""
    if server.poll() is None:
        os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)
            server.wait()
    time.sleep(2.0)  # let its port and memory go


def _cpu_busy() -> float:
    """CPU seconds spent busy on all cores since boot (/proc/stat, idle and iowait excluded)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n")[0].split()[1:]]
    user, nice, system, _idle, _iowait, irq, softirq, steal = fields[:8]
    return (user + nice + system + irq + softirq + steal) / CLK_TCK


def _tree_cpu(pids: list[int]) -> float:
    """CPU seconds of `pids` and all their descendants (user + system, reaped children too)."""
    stats: dict[int, tuple[int, float]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parts = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            ppid, cpu = int(parts[1]), sum(int(x) for x in parts[11:15]) / CLK_TCK
            stats[int(entry.name)] = (ppid, cpu)
    total, todo, seen = 0.0, list(pids), set()
    while todo:
        pid = todo.pop()
        if pid in seen or pid not in stats:
            continue
        seen.add(pid)
        total += stats[pid][1]
        todo += [child for child, (ppid, _) in stats.items() if ppid == pid]
    return total


def _children_cpu() -> float:
    usage = os.times()
    return usage.children_user + usage.children_system


def _top() -> list[str]:
    lines = subprocess.run(["top", "-bn1", "-w", "160"], capture_output=True, text=True).stdout
    return [line.rstrip() for line in lines.splitlines()[6:12]]


def _portable(text: str) -> str:
    """A command as anyone can rerun it: the repository and the peers' cache by name, not by
    where they lie on this machine."""
    text = text.replace(str(REPO_PY), ".venv/bin/python").replace(str(CACHE), "$PEERS_CACHE")
    return text.replace(f"{HERE.parent.parent}/", "")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name).strip("_")


if __name__ == "__main__":
    main()
