"""How long ``python serve.py`` takes to answer ``/health``, on a cold and then a warm compilation cache,
and the longest silence on its stderr meanwhile (a newcomer should see a line at least every 10 s).

Each run is a fresh process with ``XDG_CACHE_HOME`` in a fresh directory shared by the runs (the embedded
default pair keeps its compiled programs there); with ``--target``/``--draft``, ``--compilation-cache``
points at the same directory.

    python bench/bench_serve_start.py                                   # the embedded default pair
    python bench/bench_serve_start.py --target T --draft D --runs cold,warm
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def one_start(extra: list[str], cache_home: Path, timeout: float) -> dict:
    """Seconds from the process's start to ``/health`` answering, the longest gap between stderr lines."""
    port = free_port()
    env = {**os.environ, "XDG_CACHE_HOME": str(cache_home)}
    cmd = [sys.executable, str(REPO / "serve.py"), "--port", str(port), *extra]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    stamps: list[float] = [t0]
    lines: list[str] = []

    def read() -> None:
        for line in proc.stderr:
            stamps.append(time.perf_counter())
            lines.append(line.rstrip())

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    ready = None
    try:
        while time.perf_counter() - t0 < timeout and proc.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    ready = time.perf_counter() - t0
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        reader.join(5)
    until = t0 + (ready if ready is not None else timeout)
    before = [s for s in stamps if s <= until] + [until]
    return {"ready_s": ready, "longest_silence_s": max(b - a for a, b in zip(before, before[1:])),
            "lines_before_ready": len(before) - 2, "log": lines}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--runs", default="cold,warm", help="cold (an empty cache), warm (the cache the runs left)")
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--show-log", action="store_true")
    args = ap.parse_args()
    home = Path(tempfile.mkdtemp(prefix="serve_start_"))
    extra = []
    if args.target:
        extra = ["--target", args.target, "--draft", args.draft, "--compilation-cache",
                 str(home / "dflash-jax" / "xla")]
    results = []
    for kind in args.runs.split(","):
        res = one_start(extra, home, args.timeout)
        res["kind"] = kind
        results.append(res)
        ready = "did not come up" if res["ready_s"] is None else f"{res['ready_s']:.1f} s"
        print(f"{kind}: ready {ready}; longest silence on stderr {res['longest_silence_s']:.1f} s "
              f"({res['lines_before_ready']} lines before ready)", flush=True)
        if args.show_log:
            print("\n".join("    " + line for line in res["log"]))
    print("\n| run | ready (s) | longest silence (s) |\n|---|---:|---:|")
    for res in results:
        print(f"| {res['kind']} | {res['ready_s'] if res['ready_s'] is None else round(res['ready_s'], 1)} | "
              f"{res['longest_silence_s']:.1f} |")
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
