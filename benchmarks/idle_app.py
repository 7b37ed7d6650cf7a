"""What an idle app costs the machine: each process's CPU (from /proc) and, as root, how often
its threads are switched in (the kernel's sched_switch events through tracefs), over a
window. On a small machine an engine shares its cores with all of it, and each switch-in
during a step can preempt one of the engine's threads while the other waits at a barrier.

    kvray serve -c FILE &     # the app, idle
    python -m benchmarks.idle_app [--seconds 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import time
from pathlib import Path

from benchmarks import write_result
from benchmarks.sched_trace import TRACING, process_name, thread_owners

SWITCH_IN = re.compile(r"==> next_comm=.* next_pid=(\d+)")


def cpu_ticks() -> dict[int, int]:
    """Each process's user + system ticks, by pid."""
    ticks = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            fields = stat[stat.rindex(")") + 2 :].split()
            ticks[int(entry)] = int(fields[11]) + int(fields[12])
    return ticks


def switch_ins(seconds: float) -> collections.Counter[int] | None:
    """Switch-ins per thread over `seconds` (None: no tracefs here)."""
    if not (TRACING / "trace").exists() or os.geteuid() != 0:
        time.sleep(seconds)
        return None
    (TRACING / "tracing_on").write_text("0")
    (TRACING / "trace").write_text("")
    (TRACING / "events/sched/sched_switch/enable").write_text("1")
    (TRACING / "tracing_on").write_text("1")
    time.sleep(seconds)
    (TRACING / "tracing_on").write_text("0")
    (TRACING / "events/sched/sched_switch/enable").write_text("0")
    counts: collections.Counter[int] = collections.Counter()
    for line in (TRACING / "trace").read_text().splitlines():
        m = SWITCH_IN.search(line)
        if m and m[1] != "0":
            counts[int(m[1])] += 1
    (TRACING / "trace").write_text("")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--out", help="write the result here (JSON)")
    args = ap.parse_args(argv)

    before = cpu_ticks()
    switches = switch_ins(args.seconds)
    after = cpu_ticks()
    owners, _ = thread_owners()
    hz = os.sysconf("SC_CLK_TCK")
    cpu: collections.Counter[str] = collections.Counter()
    for pid, ticks in after.items():
        if pid in before and pid != os.getpid():
            cpu[process_name(pid)] += 100 * (ticks - before[pid]) / hz / args.seconds
    wakes: collections.Counter[str] = collections.Counter()
    for tid, count in (switches or {}).items():
        owner = owners.get(tid)
        if owner is not None and owner != os.getpid():
            wakes[process_name(owner)] += count / args.seconds
    names = sorted(set(cpu) | set(wakes), key=lambda n: -cpu[n])
    print(f"over {args.seconds:.0f} s: % of one core, switch-ins per second")
    for name in names:
        if cpu[name] >= 0.05 or wakes[name] >= 1:
            print(f"{name:40s} {cpu[name]:6.2f} %  {wakes[name]:7.1f}/s")
    print(f"{'all':40s} {sum(cpu.values()):6.2f} %  {sum(wakes.values()):7.1f}/s")
    write_result(args.out, args, cpu_percent=dict(cpu), switch_ins_per_s=dict(wakes))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
