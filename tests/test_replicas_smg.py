"""End to end: two tiny radixlm replicas (`radixlm serve` processes) behind a real smg process.

smg is a dev dependency (a Rust gateway wheel, `pip install smg`); where it cannot be installed
this test skips and says so. Everything binds 127.0.0.1.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from live_server import save_tiny_chat_model

from radixlm.bench.online_replicas import LocalCluster, smg_executable
from radixlm.cli import main

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(
        smg_executable() is None,
        reason="smg is not installed (pip install -e '.[dev]' brings it; a manylinux wheel)",
    ),
]
NUM_GROUPS, PER_GROUP = 4, 4


def test_prefix_groups_stay_on_one_replica_behind_smg(tmp_path: Path) -> None:
    model = save_tiny_chat_model(tmp_path / "model", context_len=1024)
    ports = _free_ports(4)  # gateway, two replicas, the gateway's metrics
    out = tmp_path / "bench.json"
    with LocalCluster(tmp_path / "logs", model=str(model)) as cluster:
        replicas = cluster.start_replicas(
            ports[1:3], 1, 4096, worker_ids=["replica-a", "replica-b"]
        )
        urls = [r.url for r in replicas]
        gateway = cluster.start_smg(urls, ports[0], "cache_aware", metrics_port=ports[3])
        loads = _gateway_loads(gateway.url, len(urls))  # smg parsed both replicas' /v1/loads
        assert sorted(load["max_total_num_tokens"] for load in loads) == [4096, 4096]

        argv = [
            "bench", "serve", "--base-url", gateway.url, "--workload", "gsp",
            "--param", f"num_groups={NUM_GROUPS}", "--param", f"prompts_per_group={PER_GROUP}",
            "--param", "system_prompt_len=40", "--param", "question_len=4",
            "--param", "output_len=4", "--token-range", "3:256", "--prompt-format", "chat",
            "--stream", "one-per-group", "--concurrency", "4", "--timeout", "60",
            "--server-url", urls[0], "--server-url", urls[1], "--json", str(out),
        ]  # fmt: skip
        assert main(argv) == 0
        summary = json.loads(out.read_text())["summary"]

        flushed = httpx.post(f"{gateway.url}/flush_cache", timeout=30)  # smg fans it out
        assert flushed.status_code == 200, flushed.text
        trees = [httpx.get(f"{u}/v1/cache", timeout=30).json()["num_tree_tokens"] for u in urls]

    assert summary["num_errors"] == 0 and summary["num_ok"] == NUM_GROUPS * PER_GROUP
    assert set(summary["requests_by_worker"]) <= {"replica-a", "replica-b"}
    # cache_aware keeps a group where its prefix is: at most one request of a group elsewhere
    assert len(summary["group_affinity"]) == NUM_GROUPS
    assert summary["min_group_affinity"] >= (PER_GROUP - 1) / PER_GROUP, summary["group_affinity"]
    assert summary["hit_rate"] > 0.4
    assert summary["num_streams"] == NUM_GROUPS == summary["num_streams_usage_then_done"]
    # every replica balanced its slots and holds nothing for a request once the load is gone
    assert [s["accounting_ok"] for s in summary["servers"]] == [True, True]
    assert [s["num_in_flight"] for s in summary["servers"]] == [0, 0]
    assert summary["server_prefill_tokens"] >= summary["ideal_prefill_tokens"] > 0
    assert trees == [0, 0]


def _gateway_loads(url: str, num_workers: int) -> list[dict[str, Any]]:
    deadline = time.monotonic() + 30  # smg polls each worker's /v1/loads (first poll at start)
    while True:
        loads = httpx.get(f"{url}/get_loads", timeout=10).json().get("loads", [])
        if len(loads) == num_workers or time.monotonic() > deadline:
            return list(loads)
        time.sleep(0.5)


def _free_ports(n: int) -> list[int]:
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports
