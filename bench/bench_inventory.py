"""The control plane against the inventory's size: validate-all, render one, deploy --check one, the clash.

    .venv/bin/python bench/bench_inventory.py [--hosts 100,1000,5000] [--rounds 1] [--limit 120]

Each inventory is generated the way Ansible users keep theirs: `defaults` (the model, the accelerator),
two groups (`fleet` holding every host, `rack-K` a rack of 50), and N SSH hosts of 8 instances each,
every one with its own address (10.x.y.z). For each size it times, in a fresh process each so nothing
is cached between them:

- validate all: `fleet.settings.inventory.load` (every host's layers, its variables, the checks across hosts);
- render one: `inv render --host h0 --out DIR` (the whole command line, Python's start included);
- deploy --check one: `inv deploy --check --host h0`; h0's ssh address is 127.0.0.1 on a port where
  nothing listens, so the run goes through the whole control plane and ends at once at the refused
  connection (UNREACHABLE, exit 4) instead of waiting on a network;
- clash: the same file whose last host also says h1's address (so h1's ports): `inv render --host h0` must
  name the clash (exit 2, one sentence).

Then once: the issue's alias bomb (nine levels of nine aliases under `extra_args`), `inv render` must
refuse it in one sentence (exit 2).

Each cell is wall-clock seconds and, in brackets, the CPU seconds the process used (what a busy machine
changes least). A run that takes longer than --limit seconds is stopped (by its pid) and shown as `>LIMIT`.
The machine is shared: the load average before the run is printed with the table.
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable


def inventory_text(hosts: int, clash: bool = False, closed_port: int = 9) -> str:
    """A valid inventory of `hosts` SSH hosts x 8 instances; `clash`: the last host says h1's address."""
    lines = ["defaults:", "  accelerator: nvidia", "  accelerators: 8", "  instances: 8",
             "  model: /data/models/Qwen2.5-7B-Instruct", "  deploy_dir: /srv/vllm-fleet",
             "  ssh: {user: ops, connect_timeout_s: 5}",
             "groups:", "  fleet:", "    hosts: [" + ", ".join(f"h{i}" for i in range(hosts)) + "]",
             "    max_num_seqs: 8"]
    for rack in range(0, hosts, 50):
        lines += [f"  rack-{rack // 50}:",
                  "    hosts: [" + ", ".join(f"h{i}" for i in range(rack, min(hosts, rack + 50))) + "]",
                  f"    release_timeout_s: {60 + rack // 50 % 30}"]
    lines.append("hosts:")
    for i in range(hosts):
        if i == 0:
            address = f"{{host: 127.0.0.1, port: {closed_port}}}"
        elif clash and i == hosts - 1:
            address = "{host: 10.0.0.1}"                      # h1's machine, and the same ports
        else:
            address = f"{{host: 10.{i >> 16 & 255}.{i >> 8 & 255}.{i & 255}}}"
        lines += [f"  h{i}:", f"    ssh: {address}", f"    served_model_name: qwen-{i % 7}"]
    return "\n".join(lines) + "\n"


def bomb_text() -> str:
    """Nine levels of nine aliases under extra_args: 9^9 strings once expanded, 15 lines written."""
    items = ["      - &a0 [lol, lol, lol, lol, lol, lol, lol, lol, lol]"]
    items += [f"      - &a{i} [" + ", ".join([f"*a{i - 1}"] * 9) + "]" for i in range(1, 10)]
    return ("hosts:\n  h0:\n    connection: local\n    engine: sim\n    accelerator: sim\n    extra_args:\n"
            + "\n".join(items) + "\n")


def closed_port() -> int:
    """A loopback port where nothing listens (bound, then released)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(cmd: list[str], limit: float, env: dict) -> tuple[float | None, int, str]:
    """Run cmd; (seconds or None past the limit, exit code, the last line of its standard error).
    The seconds are wall-clock; the CPU seconds the process used go to CPU[cmd_key(cmd)]."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True)
    try:
        _, err = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        return None, -1, ""
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    CPU.append(after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime)
    last = [line for line in err.splitlines() if line.strip()]
    return wall, proc.returncode, last[-1] if last else ""


CPU: list[float] = []     # the CPU seconds of each timed run, in order


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hosts", default="100,1000,5000")
    ap.add_argument("--rounds", type=int, default=1, help="runs of each case; the table shows the median")
    ap.add_argument("--limit", type=float, default=120.0, help="seconds after which a case is stopped")
    args = ap.parse_args()
    sizes = [int(n) for n in args.hosts.split(",")]
    inv_bin = str(Path(PYTHON).parent / "inv")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("FLEET_INVENTORY", None)
    load1, load5, _ = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        port = closed_port()
        for n in sizes:
            good, bad = Path(tmp, f"hosts-{n}.yml"), Path(tmp, f"clash-{n}.yml")
            good.write_text(inventory_text(n, closed_port=port))
            bad.write_text(inventory_text(n, clash=True, closed_port=port))
            cases = {
                "validate all": ([PYTHON, "-c", f"from fleet.settings import inventory; inventory.load({str(good)!r})"], 0),
                "render one": ([inv_bin, "render", "--host", "h0", "--out", str(Path(tmp, f"out-{n}")),
                                "-i", str(good)], 0),
                "deploy --check one": ([inv_bin, "deploy", "--check", "--host", "h0", "-i", str(good)], 4),
                "clash named": ([inv_bin, "render", "--host", "h0", "--out", str(Path(tmp, f"bad-{n}")),
                                 "-i", str(bad)], 2),
            }
            row = {"hosts": n, "size": good.stat().st_size}
            for name, (cmd, want) in cases.items():
                times, cpus = [], []
                for _ in range(args.rounds):
                    seconds, code, last = timed(cmd, args.limit, env)
                    cpus.append(CPU[-1])
                    if seconds is not None and code != want:
                        sys.exit(f"{name} on {n} hosts: exit {code}, expected {want}: {last}")
                    times.append(seconds)
                    if seconds is None:
                        break
                done = sorted(t for t in times if t is not None)
                row[name] = None if len(done) < len(times) else done[len(done) // 2]
                row[name + " cpu"] = sorted(cpus)[len(cpus) // 2]
                if name == "clash named":
                    row["sentence"] = last
            rows.append(row)
            print(f"{n} hosts done", file=sys.stderr, flush=True)
        bomb = Path(tmp, "bomb.yml")
        bomb.write_text(bomb_text())
        bomb_s, bomb_code, bomb_last = timed([inv_bin, "render", "--host", "h0", "--out", str(Path(tmp, "b")),
                                              "-i", str(bomb)], args.limit, env)
    names = ["validate all", "render one", "deploy --check one", "clash named"]
    print(f"load average before the run: {load1:.2f} (1 min), {load5:.2f} (5 min); "
          f"{os.cpu_count()} cores; median of {args.rounds} run(s), each in a fresh process: wall-clock "
          "seconds (CPU seconds of the process)")
    print()
    print("| hosts | file | " + " | ".join(names) + " |")
    print("|---:|---:|" + "---:|" * len(names))
    for row in rows:
        cells = [f">{args.limit:g}" if row[k] is None else f"{row[k]:.2f} ({row[k + ' cpu']:.2f})"
                 for k in names]
        print(f"| {row['hosts']:,} | {row['size'] / 1024:,.0f} KiB | " + " | ".join(cells) + " |")
    print()
    for row in rows:
        print(f"clash, {row['hosts']:,} hosts: {row.get('sentence', '')}")
    shown = f">{args.limit:g} s" if bomb_s is None else f"{bomb_s:.2f} s ({CPU[-1]:.2f} s CPU), exit {bomb_code}"
    print(f"alias bomb (inv render): {shown}: {bomb_last}")


if __name__ == "__main__":
    main()
