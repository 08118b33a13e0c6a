"""RSS of a command over time, with the phase it was in: where a comparison peaks.

    python benchmarks/rss_trace.py OUT -- fedjax-sim compare ifca-rotated-mnist \
        --set n=50 rounds=2 eval_every=2 --out DIR

Runs the command, reads its VmRSS from /proc/PID/status every 0.25 s and marks
each sample with the last progress line the command printed (e.g. "local: 3/10
rounds": the samples after it are local's fourth round, or what follows the
method's last round: the next method's init). Writes OUT.rss (time, kB, marker),
OUT.log (the command's output with times) and OUT.json: wall seconds, the child's
user and system CPU seconds and ru_maxrss, the sampled peak and its phase, the
maximum RSS per phase, the CPU model, git HEAD and the load average at start and end.
"""

from __future__ import annotations

import json
import os
import re
import resource
import subprocess
import sys
import threading
import time
from pathlib import Path

PROGRESS = re.compile(r"(\w+): (\d+)/(\d+) rounds")


def cpu_model() -> str:
    out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    return next((line.split(":", 1)[1].strip() for line in out.splitlines()
                 if line.startswith("Model name")), "unknown")


def main(argv: list[str]) -> None:
    if "--" not in argv or argv.index("--") != 1:
        raise SystemExit(__doc__)
    out, cmd = Path(argv[0]), argv[2:]
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                          text=True).stdout.strip()
    load_start = os.getloadavg()
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    marker = ["start"]
    log = open(out.with_suffix(".log"), "w")

    def read():  # progress lines end in \r on a terminal, \n elsewhere
        buf = ""
        while ch := proc.stdout.read(1):
            if ch not in "\r\n":
                buf += ch
                continue
            if buf.strip():
                log.write(f"{time.perf_counter() - t0:8.2f} {buf.strip()}\n")
                log.flush()
                if m := PROGRESS.search(buf):
                    marker[0] = f"after {m.group(1)} {m.group(2)}/{m.group(3)}"
            buf = ""

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    phases: dict[str, int] = {}
    peak = (0, 0.0, "")
    with open(out.with_suffix(".rss"), "w") as samples:
        while proc.poll() is None:
            try:
                status = Path(f"/proc/{proc.pid}/status").read_text()
            except FileNotFoundError:
                break
            found = [line.split()[1] for line in status.splitlines()
                     if line.startswith("VmRSS")]
            if not found:  # exiting: no memory left to read
                break
            kb = int(found[0])
            t = time.perf_counter() - t0
            samples.write(f"{t:8.2f} {kb} {marker[0]}\n")
            phases[marker[0]] = max(phases.get(marker[0], 0), kb)
            if kb > peak[0]:
                peak = (kb, t, marker[0])
            time.sleep(0.25)
    proc.wait()
    reader.join(timeout=5)
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    record = {
        "command": cmd, "returncode": proc.returncode,
        "wall_s": round(time.perf_counter() - t0, 1),
        "user_s": round(usage.ru_utime, 1), "sys_s": round(usage.ru_stime, 1),
        "ru_maxrss_gb": round(usage.ru_maxrss / 1e6, 3),
        "sampled_peak_gb": round(peak[0] / 1e6, 3), "peak_at_s": round(peak[1], 1),
        "peak_phase": peak[2],
        "phase_max_rss_gb": {k: round(v / 1e6, 3) for k, v in phases.items()},
        "meta": {"cpu": cpu_model(), "git_head": head, "loadavg_start": load_start,
                 "loadavg_end": os.getloadavg()},
    }
    out.with_suffix(".json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
