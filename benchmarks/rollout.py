"""Rollout routing: trl-scale's load-aware router vs an even split (what ms-swift and TRL's single-URL server
mode amount to) over K `trl-scale serve` processes of unequal speed, on the same requests, in one run.

Server i holds its model for `token_delay[i]` seconds per generated token, so it has a fixed, unequal
throughput. Even split: each server gets N/K requests. Router: one client over all servers, at most one request
in flight per server, each request to the server with the least outstanding work. Ideal: N / sum of the
servers' measured request rates.

Usage: python benchmarks/rollout.py [--quick]. The last line printed is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import requests

from trl_scale.net import free_port


def start_server(model_path: str, token_delay: float, cpus: set[int] | None = None) -> tuple[subprocess.Popen, str]:
    """A `trl-scale serve` process on one thread; `cpus` pins it to those cores (Linux)."""
    port = free_port("127.0.0.1")
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    command = [sys.executable, "-m", "trl_scale.cli", "serve", "--model", model_path, "--port", str(port)]
    command += ["--token-delay", str(token_delay)]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    process = subprocess.Popen(command, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, preexec_fn=pin)
    return process, f"http://127.0.0.1:{port}"


def wait_ready(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except requests.ConnectionError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"{url} not ready")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    from trl_scale.rollout import RolloutClient
    from trl_scale.toy import build_tiny_model

    delays = [0.002, 0.006, 0.012]  # seconds per token: throughputs 1 : 1/3 : 1/6
    num_requests = 48 if args.quick else 192
    max_tokens = 16
    model_path = build_tiny_model(tempfile.mkdtemp(prefix="rollout-bench-"))
    servers = [start_server(model_path, d) for d in delays]
    try:
        for _, url in servers:
            wait_ready(url)
        urls = [url for _, url in servers]
        sampling = dict(max_tokens=max_tokens, temperature=1.0)
        prompts = [[432, 375, 373]] * num_requests

        # Each server's request rate, alone (for the ideal).
        rates = []
        for url in urls:
            client = RolloutClient([url], max_inflight_per_server=1)
            client.generate(prompts[:2], **sampling)  # warm-up
            start = time.perf_counter()
            client.generate(prompts[:6], **sampling)
            rates.append(6 / (time.perf_counter() - start))
            client.close()
        ideal = num_requests / sum(rates)

        # Even split: N/K requests per server, servers in parallel.
        shares = [prompts[i :: len(urls)] for i in range(len(urls))]
        clients = [RolloutClient([url], max_inflight_per_server=1) for url in urls]
        start = time.perf_counter()
        with ThreadPoolExecutor(len(urls)) as pool:
            list(pool.map(lambda pair: pair[0].generate(pair[1], **sampling), zip(clients, shares)))
        even = time.perf_counter() - start

        # Router over all servers.
        router = RolloutClient(urls, max_inflight_per_server=1)
        start = time.perf_counter()
        router.generate(prompts, **sampling)
        routed = time.perf_counter() - start
        served = [s.served for s in router.servers]
    finally:
        for process, _ in servers:
            process.kill()
    print(f"{len(urls)} servers, token delays {delays} s, {num_requests} requests x {max_tokens} tokens")
    print(f"{'server':<26}{'req/s alone':>12}{'router share':>14}")
    for url, rate, count in zip(urls, rates, served):
        print(f"{url:<26}{rate:>12.1f}{count:>14}")
    print(f"even split {even:.2f} s | router {routed:.2f} s | ideal {ideal:.2f} s")
    print(f"router vs even split: {even / routed:.2f}x   router vs ideal: {ideal / routed:.2f}")
    print(
        json.dumps(
            {
                "benchmark": "rollout",
                "quick": args.quick,
                "num_servers": len(urls),
                "num_requests": num_requests,
                "even_split_s": even,
                "router_s": routed,
                "ideal_s": ideal,
                "router_vs_even_split": even / routed,
                "router_vs_ideal": ideal / routed,
                "router_share": served,
            }
        )
    )


if __name__ == "__main__":
    main()
