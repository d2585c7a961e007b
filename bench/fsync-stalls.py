#!/usr/bin/env python3
"""How long does fdatasync take on this disk, idle and with the CPUs busy?

`--durability full` answers a grant only after the fdatasync that covers its WAL record, so
no reply can come sooner than the fsyncs it waits for, and an fsync stall is a stall of every
reply behind it. This appends small records to a file and fdatasyncs after each, back to back
(as the WAL's syncer does under load), for --seconds; then again with --busy processes each
spinning a core. It prints the latency distribution and how many fsyncs took over 2 ms and
over 10 ms, and the share of the time spent inside those.

Usage: bench/fsync-stalls.py [--dir DIR] [--seconds 10] [--busy 1] [--record-bytes 1500]

The file lives in DIR (default: a temporary directory; pick one on the disk tenured's
--data-dir is on) and is removed at the end; the spinners are stopped by PID.
"""
import argparse
import multiprocessing
import os
import tempfile
import time


def spin(stop_at):
    while time.monotonic() < stop_at:
        pass


def measure(path, seconds, record):
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    lat = []
    try:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            os.write(fd, record)
            started = time.perf_counter()
            os.fdatasync(fd)
            lat.append(time.perf_counter() - started)
    finally:
        os.close(fd)
        os.unlink(path)
    return lat


def report(label, lat, seconds):
    lat.sort()
    n = len(lat)

    def q(p):
        return lat[min(n - 1, int(p * n))] * 1e3

    over2 = [x for x in lat if x > 0.002]
    over10 = [x for x in lat if x > 0.010]
    print(
        f"{label:<22} fsyncs/s {n / seconds:7.0f}  p50 {q(0.5):6.3f}  p99 {q(0.99):6.3f}  "
        f"p99.9 {q(0.999):7.3f}  max {lat[-1] * 1e3:6.1f} ms  >2 ms: {len(over2):4d}  "
        f">10 ms: {len(over10):4d} ({100 * len(over10) / n:.2f} %, "
        f"{100 * sum(over10) / seconds:.1f} % of the time)"
    )


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--busy", type=int, default=1, help="spinning processes in the second run")
    parser.add_argument("--record-bytes", type=int, default=1500)
    args = parser.parse_args()
    if not 0 < args.seconds <= 120:
        parser.error("--seconds must be in (0, 120]")
    if not 0 <= args.busy <= 2 * (os.cpu_count() or 1):
        parser.error("--busy must be between 0 and twice the core count")
    record = b"x" * args.record_bytes
    with tempfile.TemporaryDirectory(dir=args.dir) as work:
        path = os.path.join(work, "fsync-probe")
        report("idle", measure(path, args.seconds, record), args.seconds)
        if args.busy:
            stop_at = time.monotonic() + args.seconds + 1
            spinners = [multiprocessing.Process(target=spin, args=(stop_at,)) for _ in range(args.busy)]
            for p in spinners:
                p.start()
            try:
                time.sleep(0.2)
                lat = measure(path, args.seconds, record)
            finally:
                for p in spinners:
                    p.terminate()
                    p.join()
            report(f"{args.busy} core(s) spinning", lat, args.seconds)


if __name__ == "__main__":
    main()
