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

`--rounds N` repeats the whole pass N times, the engines alternating: round k runs every engine
in turn (in reverse order on odd rounds, so neither side always goes first), each from a fresh
server. A round is thus exactly a one-round run, same seed and a cold cache but for the warm-up,
and an engine's rounds sit minutes from the other engines' rounds of the same index, so a ratio
per round compares runs made side by side. Restarting, rather than flushing a warm server, is
the one reset every engine has (llama-server has no flush) and keeps first-request costs in
every round alike. The JSON's top level is the median round (see _merge_rounds); `rounds` holds
every round's summary and contention.
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
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from engines import (
    CACHE,
    CONCURRENCY,
    ENGINES,
    HERE,
    ISA_CAPS,
    QUICK,
    QUICK_SERVED,
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
    parser.add_argument("--rounds", type=int, default=1, help="passes, engines alternating")
    parser.add_argument(
        "--out", type=Path, default=None,
        help="default: results/runs[-ISA]; with --quick $PEERS_CACHE/runs-quick[-ISA]",
    )  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="tiny workloads: check the setup")
    args = parser.parse_args()
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    if args.out is None:  # a quick check never overwrites the recorded results
        folder = CACHE / "runs-quick" if args.quick else RUNS
        args.out = folder if args.isa == "native" else folder.with_name(f"{folder.name}-{args.isa}")
    if args.quick:
        for name, params in QUICK.items():
            WORKLOADS[name] = {**WORKLOADS[name], **params}
        for name, (client_workload, params) in QUICK_SERVED.items():
            SERVED[name] = (client_workload, {**SERVED[name][1], **params})
    # a SIGTERM (timeout, kill) unwinds through run_server's `finally`, which stops the engine
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    (CACHE / "logs").mkdir(parents=True, exist_ok=True)
    found = versions()
    run_id = _utc_now()  # pairs the rounds of one invocation across engines' files
    measured: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for round_index in range(args.rounds):
        order = args.engines if round_index % 2 == 0 else args.engines[::-1]
        for name in order:
            engine = with_isa(ENGINES[name], args.isa)
            print(f"== round {round_index + 1}/{args.rounds}: {engine.name}", flush=True)
            try:
                results = _run_engine(engine, args.workloads, args.out, found, round_index)
            except (RuntimeError, subprocess.CalledProcessError) as error:
                print(f"!! {engine.name}, round {round_index + 1}: {error}", file=sys.stderr)
                continue
            for workload, result in results.items():
                result["round"] = {"index": round_index, "run_id": run_id}
                measured.setdefault((engine.name, workload), []).append(result)
                # rewritten after every round: an interrupted run keeps what it measured
                path = args.out / f"{_slug(engine.name)}__{workload}.json"
                merged = _merge_rounds(measured[(engine.name, workload)], args.rounds, run_id)
                path.write_text(json.dumps(merged, indent=2))


def _run_engine(
    engine: Engine, workloads: list[str], out: Path, found: dict[str, str], round_index: int
) -> dict[str, dict[str, Any]]:
    """One round of one engine: workload -> its result (a failed workload is left out)."""
    if engine.port:
        return run_server(engine, workloads, out, found, round_index)
    results = {}
    for workload in workloads:
        cmd = [*engine.command, *_workload_flags(workload), "--json", "{out}"]
        result = _measure(engine, workload, cmd, [], out, found)
        if result is not None:
            results[workload] = result
    return results


def run_server(
    engine: Engine, workloads: list[str], out: Path, found: dict[str, str], round_index: int = 0
) -> dict[str, dict[str, Any]]:
    """Start `engine`, warm it up, run each workload against it, stop it: workload -> result."""
    log = open(CACHE / "logs" / f"{_slug(engine.name)}.log", "a" if round_index else "w")  # noqa: SIM115
    log.write(f"== round {round_index + 1}, started {_utc_now()}\n")
    log.flush()
    server = subprocess.Popen(
        engine.command, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        env={**os.environ, **engine.env},
    )  # fmt: skip
    results = {}
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
            result = _measure(engine, workload, cmd, [server.pid], out, found)
            if result is not None:
                results[workload] = result
    finally:
        _stop(server)
        log.close()
    return results


def _measure(
    engine: Engine, workload: str, cmd: list[str], pids: list[int], out: Path, found: dict[str, str]
) -> dict[str, Any] | None:
    """Run one client command (or offline script): its JSON with the contention, or None if it
    failed. The client writes to a .part file, which main merges into the round's record."""
    path = out / f"{_slug(engine.name)}__{workload}.part"
    cmd = [c.replace("{out}", str(path)) for c in cmd]
    print(f"== {engine.name} / {workload}: {' '.join(cmd)}", flush=True)
    load_before, top_before, started = os.getloadavg()[0], _top(), _utc_now()
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
        return None
    result = json.loads(path.read_text())
    path.unlink()
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
    result["started"] = started
    print(
        f"   contention: {result['contention']['other_busy_cores']:.2f} other cores busy",
        flush=True,
    )
    return result


def _merge_rounds(rounds: list[dict[str, Any]], asked: int, run_id: str) -> dict[str, Any]:
    """One (engine, workload) file from its rounds: the median round's full record (the lower
    of the two middle ones for an even count), so every field of `summary` and `contention`
    comes from one and the same run and the file reads as a one-round file does; `rounds` lists
    every round's summary and contention in the order they ran."""
    ranked = sorted(rounds, key=lambda r: r["summary"]["output_tok_s"])
    median = ranked[(len(ranked) - 1) // 2]
    merged = {k: v for k, v in median.items() if k not in ("round", "started")}
    merged["config"] = {
        **median["config"],
        "run_id": run_id,
        "rounds_asked": asked,
        "summary_round": median["round"]["index"],
        "summary_rule": "the round with the median output_tok_s (lower median for an even "
        "count); every summary and contention field from that round",
        "round_protocol": "engines alternate, reversed on odd rounds; a fresh server per "
        "round, same workload seed",
    }
    # the commit per round: each round restarts the server from the working tree
    merged["rounds"] = [
        {"index": r["round"]["index"], "started": r["started"], "commit": r["host"].get("commit"),
         "summary": r["summary"], "contention": r["contention"]}
        for r in rounds
    ]  # fmt: skip
    return merged


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


def _utc_now() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _slug(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name).strip("_")


if __name__ == "__main__":
    main()
