"""The cards' memory and use for the keeper's /metrics, read from the host's smi (standard library only).

The control node reads the smi through fleet/host/smi.py (every format it knows, with errors that name the
fix); the keeper needs only the figures, so this reads the same three outputs tolerantly: hy-smi's (and
the sim's) `HCU[i] : key: value` lines, `rocm-smi --json`, and nvidia-smi's CSV. Arguments per smi as
fleet/host/smi.py's SMI_ARGS gives them.
"""
from __future__ import annotations

import csv
import io
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

MIB = 1024 * 1024
SMI_ARGS = {
    "hy-smi": ["--showmeminfo", "vram", "--showuse"],
    "rocm-smi": ["--showmeminfo", "vram", "--showuse", "--json"],
    "nvidia-smi": ["--query-gpu=index,memory.used,memory.total,utilization.gpu", "--format=csv,noheader,nounits"],
}
_LINE = re.compile(r"^\s*(?:HCU|DCU|GPU)\s*\[\s*(\d+)\s*\]\s*:\s*(.*?)\s*:\s*(\S+)\s*$", re.I)


def command(cfg: dict) -> tuple[list[str], dict] | None:
    """The smi's argv and environment for this host (conf/hostagent.json's accelerator and smi), or None
    where there is no card to read (cpu) or no smi is found."""
    kind, wanted = cfg.get("accelerator"), cfg.get("smi") or ""
    if kind == "sim" and not wanted:
        lib = os.path.join(cfg["deploy_dir"], "lib")
        env = dict(os.environ, PYTHONPATH=lib + os.pathsep + os.environ.get("PYTHONPATH", ""))
        return [sys.executable, "-m", "fleet.sim", "smi", "--dev-dir", os.path.join(cfg["deploy_dir"], "sim-dev"),
                "--showuse"], env
    if kind == "cpu" and not wanted:
        return None
    for candidate in [wanted] if wanted else cfg.get("smi_candidates") or []:
        path = shutil.which(candidate)
        if path:
            return [path, *SMI_ARGS.get(os.path.basename(path), [])], dict(os.environ)
    return None


def parse(text: str) -> dict[int, dict]:
    """card -> {"used": bytes, "total": bytes, "use": fraction}, whatever of them the output gives."""
    cards: dict[int, dict] = {}
    text = text.strip()
    if text.startswith("{"):
        for name, fields in json.loads(text, strict=False).items():
            m = re.match(r"^card(\d+)$", name, re.I)
            if m and isinstance(fields, dict):
                for key, value in fields.items():
                    _apply(cards.setdefault(int(m.group(1)), {}), key, value)
        return cards
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            _apply(cards.setdefault(int(m.group(1)), {}), m.group(2), m.group(3))
    if not cards:                       # nvidia-smi: index, memory.used, memory.total, utilization.gpu (MiB, %)
        for row in csv.reader(io.StringIO(text)):
            try:
                index, used, total, use = (float(c) for c in row)
            except ValueError:
                continue
            cards[int(index)] = {"used": used * MIB, "total": total * MIB, "use": use / 100}
    return cards


def _apply(card: dict, key: str, value) -> None:
    k = " ".join(key.lower().split())
    try:
        number = float(re.match(r"^\s*(-?\d+(?:\.\d+)?)", str(value)).group(1))
    except AttributeError:
        return
    unit = re.search(r"\((b|mib|mb)\)", k)
    if k.startswith("vram") and "memory" in k and unit:
        scale = 1 if unit.group(1) == "b" else MIB
        card["used" if "used" in k else "total"] = number * scale
    elif re.match(r"^(?:hcu|dcu|gpu) use \(%\)$", k):
        card["use"] = number / 100


class Sampler:
    """The cards' figures, read at most every `min_interval_s` (a scrape in between gets the last ones)."""

    def __init__(self, cfg: dict, log, min_interval_s: float = 2.0, _run=subprocess.run, _clock=time.monotonic):
        self.cfg, self.log, self.min_interval_s = cfg, log, min_interval_s
        self.run, self.clock = _run, _clock
        self.lock = threading.Lock()
        self.cards: dict[int, dict] = {}
        self.at: float | None = None
        self.failed = False

    def sample(self) -> dict[int, dict]:
        with self.lock:
            if self.at is not None and self.clock() - self.at < self.min_interval_s:
                return self.cards
            self.at = self.clock()
            cmd = command(self.cfg)
            if cmd is None:
                self.cards = {}
                return self.cards
            try:
                r = self.run(cmd[0], env=cmd[1], capture_output=True, text=True, timeout=10)
                self.cards = parse(r.stdout) if r.returncode == 0 else {}
                why = "" if self.cards else f"exit {r.returncode}, {len(r.stdout)} bytes read"
            except (OSError, subprocess.SubprocessError, ValueError) as e:
                self.cards, why = {}, str(e)
            if why and not self.failed:          # said once, not at every scrape
                self.log.warning("cards' memory not in /metrics: %s gave no card (%s)", cmd[0][0], why)
            self.failed = bool(why)
            return self.cards


def metrics_lines(cards: dict[int, dict], deployment: str) -> list[str]:
    """fleet_card_memory_used_bytes, fleet_card_memory_total_bytes, fleet_card_utilization (0-1) by card."""
    lines = []
    for name, key, doc in (("fleet_card_memory_used_bytes", "used", "Memory used on the card, from the smi."),
                           ("fleet_card_memory_total_bytes", "total", "The card's memory, from the smi."),
                           ("fleet_card_utilization", "use", "The card's utilisation (0-1), from the smi.")):
        samples = [f'{name}{{card="{i}",deployment="{deployment}"}} {float(c[key])}'
                   for i, c in sorted(cards.items()) if key in c]
        if samples:
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} gauge", *samples]
    return lines
