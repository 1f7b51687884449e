"""The `sim` accelerator: device files under a directory, who holds them, and an hy-smi look-alike."""
from __future__ import annotations

import json
import os
import re
import time
from pathlib import Path

RENDER_BASE = 128
TOTAL_MIB = 65520
IDLE_MIB = 2
# What one engine process "allocates": a K100_AI running vLLM at --gpu-memory-utilization 0.8.
ENGINE_MIB = 52000
# A utilisation file older than this is a leftover, not a measurement.
USE_MAX_AGE_S = 5.0

_RENDER_RE = re.compile(r"renderD(\d+)$")


def default_dev_dir(environ=None) -> Path:
    """DEV_DIR from FLEET_SIM_DEV_DIR, else ./sim-dev."""
    env = os.environ if environ is None else environ
    return Path(env.get("FLEET_SIM_DEV_DIR") or "sim-dev")


# The variables that list an engine's cards, first set wins: the sim accelerator's own (what the fleet
# sets for accelerator sim), then ROCm's and CUDA's, so the sim also runs under a real host's settings.
VISIBLE_VARS = ("SIM_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")


def visible_cards(environ=None, dev_dir=None) -> list[int]:
    """The cards this engine may use: the first visible-devices variable set ("2,3"), else every card
    under dev_dir (as vLLM sees every GPU when none is set), else card 0."""
    env = os.environ if environ is None else environ
    for var in VISIBLE_VARS:
        value = env.get(var)
        if value is not None and value.strip():
            return [int(c) for c in (x.strip() for x in value.split(",")) if c.isdigit()]
    return cards(dev_dir if dev_dir is not None else default_dev_dir(env)) or [0]


def render_path(dev_dir, card: int) -> Path:
    """The renderD file of a card."""
    return Path(dev_dir) / f"renderD{RENDER_BASE + card}"


def use_path(dev_dir, card: int) -> Path:
    """The per-card utilisation file the engine writes."""
    return Path(dev_dir) / f"use{card}"


def ensure_card(dev_dir, card: int | list[int]) -> list[Path]:
    """Create DEV_DIR, kfd and the renderD file of a card (or of each of a list of cards) if missing;
    their paths."""
    d = Path(dev_dir)
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / "kfd", *(render_path(d, c) for c in ([card] if isinstance(card, int) else card))]
    for p in paths:
        p.touch(exist_ok=True)
    return paths


def cards(dev_dir) -> list[int]:
    """The cards whose renderD file exists, sorted."""
    try:
        names = os.listdir(dev_dir)
    except OSError:
        return []
    found = (_RENDER_RE.match(n) for n in names)
    return sorted(int(m.group(1)) - RENDER_BASE for m in found if m and int(m.group(1)) >= RENDER_BASE)


def holders(dev_dir) -> dict[int, list[int]]:
    """Card -> pids of the live processes (any user) holding its renderD file open."""
    wanted = {os.path.realpath(render_path(dev_dir, c)): c for c in cards(dev_dir)}
    held: dict[int, set[int]] = {c: set() for c in wanted.values()}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        fd_dir = f"/proc/{entry.name}/fd"
        try:
            fds = os.listdir(fd_dir)
        except OSError:  # another user's process, or gone: skipped, as hy-smi's view would be partial too
            continue
        for fd in fds:
            try:
                target = os.readlink(f"{fd_dir}/{fd}")
            except OSError:
                continue
            card = wanted.get(target)
            if card is not None:
                held[card].add(int(entry.name))
    return {c: sorted(p) for c, p in held.items()}


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (zombies count as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def write_use(dev_dir, card: int, percent: float) -> None:
    """Record this process's utilisation of a card (atomically, so smi never reads half a file)."""
    path = use_path(dev_dir, card)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "use": round(percent, 1), "time": time.time()}))
    os.replace(tmp, path)


def read_use(dev_dir, card: int) -> float:
    """A card's utilisation in percent: the engine's file when fresh and its writer alive, else 0."""
    try:
        rec = json.loads(use_path(dev_dir, card).read_text())
        fresh = time.time() - float(rec["time"]) <= USE_MAX_AGE_S
        return float(rec["use"]) if fresh and pid_alive(int(rec["pid"])) else 0.0
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def smi_report(dev_dir, show_use: bool = False) -> str:
    """The text of `hy-smi --showmeminfo vram [--showuse]` for the cards under dev_dir."""
    held = holders(dev_dir)
    mem, use = [], []
    for card, pids in held.items():
        prefix = f"{f'HCU[{card}]':<16}: "
        mem.append(f"{prefix}vram Total Memory (MiB): {TOTAL_MIB}")
        mem.append(f"{prefix}vram Total Used Memory (MiB): {IDLE_MIB + ENGINE_MIB * len(pids)}")
        use.append(f"{prefix}HCU use (%): {read_use(dev_dir, card):g}")
    return "\n".join(mem + (use if show_use else [])) + "\n"
