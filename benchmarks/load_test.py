"""Load on the web demo: waves of concurrent /caption requests, answers and server memory per wave.

    python benchmarks/load_test.py [--waves 5] [--requests 50] [--clients 10] [--checkpoint CKPT]

Starts `python app.py` on a free localhost port (the bundled model by default), sends each wave
of requests from the clients at once (a mix of the example scenes and beam sizes 1-3), and
prints how many were captioned or turned away as busy, latency, and the server's resident
memory after each wave (from /proc; Linux only).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS")) / 1024


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--waves", type=int, default=5)
    p.add_argument("--requests", type=int, default=50, help="requests per wave")
    p.add_argument("--clients", type=int, default=10)
    p.add_argument("--checkpoint", default=None, help="default: the bundled demo model")
    args = p.parse_args(argv)
    from gradio_client import Client, handle_file

    from captioner.serve.sources import example_images

    images = example_images()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, os.path.join(REPO, "app.py"), "--port", str(port)]
    if args.checkpoint:
        cmd += ["--checkpoint", args.checkpoint]
    log = tempfile.NamedTemporaryFile("w", suffix=".log", delete=False)
    server = subprocess.Popen(
        cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env={**os.environ, "GRADIO_ANALYTICS_ENABLED": "False"}
    )
    url = f"http://127.0.0.1:{port}/"
    try:
        for _ in range(600):
            try:
                urllib.request.urlopen(url, timeout=2)
                break
            except OSError:
                if server.poll() is not None:
                    sys.exit(f"app.py exited; see {log.name}")
                time.sleep(0.5)
        print(
            f"server up, RSS {rss_mb(server.pid):.0f} MB; {args.waves} waves of {args.requests} requests "
            f"from {args.clients} clients"
        )
        clients = [Client(url, verbose=False) for _ in range(args.clients)]
        clients[0].predict(handle_file(images[0]), 1, api_name="/caption")  # warm-up
        print(f"after warm-up: RSS {rss_mb(server.pid):.0f} MB")

        def ask(i: int):
            t0 = time.perf_counter()
            try:
                clients[i % args.clients].predict(handle_file(images[i % len(images)]), 1 + i % 3, api_name="/caption")
                return "ok", time.perf_counter() - t0
            except Exception as e:
                return ("busy" if "queue is full" in str(e).lower() else f"error: {e}"), time.perf_counter() - t0

        for wave in range(args.waves):
            t0 = time.perf_counter()
            with ThreadPoolExecutor(max_workers=args.clients) as pool:
                answers = list(pool.map(ask, range(args.requests)))
            took = time.perf_counter() - t0
            kinds = [a for a, _ in answers]
            lat = [t for a, t in answers if a == "ok"]
            errors = [k for k in kinds if k.startswith("error")]
            print(
                f"wave {wave + 1}: {kinds.count('ok')} captioned, {kinds.count('busy')} busy, {len(errors)} errors; "
                f"{took:.1f} s; latency median {statistics.median(lat):.2f} s, max {max(lat):.2f} s; "
                f"server RSS {rss_mb(server.pid):.0f} MB"
            )
            for e in errors[:3]:
                print("  ", e)
        alive = clients[0].predict(handle_file(images[0]), 1, api_name="/caption")[0]
        print(f"still answering afterwards: {alive!r}")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
