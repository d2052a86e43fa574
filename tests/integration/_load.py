"""Steady HTTP load for the cluster tests: `python _load.py URL --seconds S --concurrency C --pause P --out FILE`.

Each of C threads POSTs one digits row after another, P seconds apart (default 0: as fast as the
endpoint answers), until S seconds have passed; FILE gets every request as [start, end, status]
(wall-clock seconds; status 0 when no HTTP answer came).
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import requests


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("url")
    p.add_argument("--seconds", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--pause", type=float, default=0.0)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    body = {"instances": [[0.0] * 64]}
    stop = time.time() + args.seconds
    done: list[list[float]] = []

    def client() -> None:
        session = requests.Session()
        while time.time() < stop:
            started = time.time()
            try:
                status = session.post(args.url, json=body, timeout=30).status_code
            except requests.RequestException:
                status = 0
            done.append([started, time.time(), status])
            time.sleep(args.pause)

    threads = [threading.Thread(target=client) for _ in range(args.concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    with open(args.out, "w") as f:
        json.dump(done, f)


if __name__ == "__main__":
    main()
