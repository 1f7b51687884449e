"""Accelerator memory per card, from the accelerator's own smi: parsers, and reading it on a host.

`parse(tool, text)` reads what hy-smi (default table, `--showmeminfo vram`, `--showuse`), `rocm-smi
--json` (Hygon keys in MiB, AMD keys in bytes) and `nvidia-smi --query-gpu=... --format=csv` print, and
`python -m fleet.sim smi`, which prints hy-smi's format. Output it cannot read raises SmiError naming the
command: a card is never reported free because a line was not understood.

`read_cards(conn, hv)` finds the smi on the host (usual absolute paths first, since PATH over
non-interactive SSH lacks /opt/hyhal/bin; the inventory's `smi` key names it), runs it and parses it.
"""
from __future__ import annotations

import csv
import io
import json
import math
import re
import shlex
from dataclasses import dataclass

from hostagent import layout

from fleet.errors import FleetError, RemoteError
from fleet.settings import accelerators
from fleet.transport import agent, hostcode

NAN = math.nan


class SmiError(FleetError):
    """The smi's output could not be read, or the smi failed."""


class SmiNotFound(SmiError):
    """No smi was found on the host."""


@dataclass
class Card:
    """One card's memory (MiB) and utilisation (%).

    used_mib and total_mib are NaN when the tool did not report them (hy-smi's default table gives only
    VRAM%, kept in vram_pct; `--showmeminfo vram` lists some cards with their total only).
    """

    index: int
    used_mib: float = NAN
    total_mib: float = NAN
    util_pct: float | None = None
    vram_pct: float | None = None

    @property
    def used_fraction(self) -> float | None:
        """Used / total, from MiB when known, else from VRAM%; None when neither is known."""
        if not math.isnan(self.used_mib) and not math.isnan(self.total_mib) and self.total_mib > 0:
            return self.used_mib / self.total_mib
        if self.vram_pct is not None:
            return self.vram_pct / 100
        return None

    def show(self) -> str:
        """`52002/65520 MiB`, with `?` for what is unknown."""
        if math.isnan(self.used_mib) and math.isnan(self.total_mib) and self.vram_pct is not None:
            return f"{self.vram_pct:g}% used"
        return f"{_fmt(self.used_mib)}/{_fmt(self.total_mib)} MiB"


def _fmt(x: float) -> str:
    return "?" if math.isnan(x) else f"{x:.0f}"


# Tool names as used in messages; `parse` also takes an accelerator kind.
KIND_TOOL = {"dcu": "hy-smi", "rocm": "rocm-smi", "nvidia": "nvidia-smi", "sim": "python -m fleet.sim smi",
             "cpu": "/proc (hostagent/probes/cpu_mem.py)"}
# accelerator cpu has no smi: this script reads each instance's resident memory from /proc instead.

NVIDIA_FIELDS = ("index", "memory.used", "memory.total", "utilization.gpu")
# The arguments each smi runs with, by the binary's name: memory and utilisation, machine-readable.
SMI_ARGS = {
    "hy-smi": ["--showmeminfo", "vram", "--showuse"],
    "rocm-smi": ["--showmeminfo", "vram", "--showuse", "--json"],
    "nvidia-smi": [f"--query-gpu={','.join(NVIDIA_FIELDS)}", "--format=csv,noheader,nounits"],
}

_PREFIX = r"(?:HCU|DCU|GPU)"
# `HCU[3]\t\t: vram Total Used Memory (MiB): 12058`, `GPU[0]          : GPU use (%): 7`
_LINE = re.compile(rf"^\s*{_PREFIX}\s*\[\s*(\d+)\s*\]\s*:\s*(.*?)\s*:\s*(\S+)\s*$", re.I)
_UNIT = re.compile(r"\((B|KB|KiB|MB|MiB|GB|GiB)\)", re.I)
_TO_MIB = {"b": 1 / 2**20, "kb": 1 / 1024, "kib": 1 / 1024, "mb": 1.0, "mib": 1.0, "gb": 1024.0, "gib": 1024.0}


def parse(kind_or_tool: str, text: str) -> list[Card]:
    """The cards in an smi's output, sorted by index; SmiError naming the command when unreadable.

    kind_or_tool: an accelerator kind (dcu, rocm, nvidia, sim) or the tool (hy-smi, rocm-smi,
    nvidia-smi, or a path to one); the format itself is recognised from the text.
    """
    tool = KIND_TOOL.get(kind_or_tool, kind_or_tool)
    name = tool.rsplit("/", 1)[-1]
    stripped = text.strip()
    if not stripped:
        raise SmiError(f"`{tool}` printed nothing; run it on the host to see why.")
    try:
        if stripped.startswith("{"):
            cards = _parse_json(stripped)
        elif any(_LINE.match(line) for line in stripped.splitlines()):
            cards = _parse_lines(stripped)
        elif _table_header(stripped.splitlines()) is not None:
            cards = _parse_table(stripped)
        elif "nvidia" in name or "memory.used" in stripped:
            cards = _parse_csv(stripped)
        else:
            raise ValueError("no card lines recognised")
    except (ValueError, KeyError, TypeError) as e:
        first = stripped.splitlines()[0][:80]
        raise SmiError(f"cannot read the output of `{tool}` ({e}; it starts with {first!r}); "
                       "check the tool, or name the right one with the inventory key smi.") from None
    if not cards:
        raise SmiError(f"`{tool}` reported no card; check the driver with `{tool}` on the host.")
    if not any(c.vram_pct is not None or not (math.isnan(c.used_mib) and math.isnan(c.total_mib))
               for c in cards):
        raise SmiError(f"`{tool}` reported no memory figures; run it with the arguments "
                       f"{' '.join(SMI_ARGS.get(name, ['(see fleet/host/smi.py)']))}.")
    return cards


def _number(value) -> float | None:
    """A float from `65520`, `75 %`, `77537 MiB`, `51.0C`; None for N/A and the like."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    m = re.match(r"^\s*\[?(-?\d+(?:\.\d+)?)", str(value))
    if m:
        return float(m.group(1))
    if str(value).strip().strip("[]").lower() in ("n/a", "na", "-", "", "not supported", "unknown"):
        return None
    raise ValueError(f"not a number: {value!r}")


def _apply(card: Card, key: str, value) -> None:
    """Set one figure of a card from a `key: value` pair of hy-smi or rocm-smi."""
    k = " ".join(key.lower().split())
    unit = _UNIT.search(k)
    if k.startswith("vram") and "memory" in k:
        if not unit:
            raise ValueError(f"no unit in {key!r}")
        n = _number(value)
        mib = NAN if n is None else n * _TO_MIB[unit.group(1).lower()]
        if "used" in k:
            card.used_mib = mib
        elif "total memory" in k:
            card.total_mib = mib
    elif re.match(r"^(?:hcu|dcu|gpu)\s+use\s*\(%\)$", k):
        card.util_pct = _number(value)


def _card(cards: dict[int, Card], index: int) -> Card:
    return cards.setdefault(index, Card(index))


def _parse_lines(text: str) -> list[Card]:
    """hy-smi --showmeminfo vram / --showuse, and rocm-smi's plain text: one `PREFIX[i] : key: value` a line."""
    cards: dict[int, Card] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m:
            _apply(_card(cards, int(m.group(1))), m.group(2), m.group(3))
    return [cards[i] for i in sorted(cards)]


def _parse_json(text: str) -> list[Card]:
    """rocm-smi --json: {"card0": {"vram Total Memory (MiB)": "65520", ...}, "system": {...}}."""
    data = json.loads(text, strict=False)   # tolerate tabs inside keys
    if not isinstance(data, dict):
        raise ValueError("JSON is not an object")
    cards: dict[int, Card] = {}
    for name, fields in data.items():
        m = re.match(r"^card(\d+)$", name, re.I)
        if not m or not isinstance(fields, dict):
            continue      # "system" and other non-card sections
        card = _card(cards, int(m.group(1)))
        for key, value in fields.items():
            _apply(card, key, value)
    return [cards[i] for i in sorted(cards)]


def _table_header(lines: list[str]) -> int | None:
    for n, line in enumerate(lines):
        cols = line.split()
        if cols and re.fullmatch(_PREFIX, cols[0], re.I) and any(c.upper() == "VRAM%" for c in cols):
            return n
    return None


def _parse_table(text: str) -> list[Card]:
    """hy-smi's default table: a header `HCU Temp AvgPwr ... VRAM% HCU% ...`, then one row per card."""
    lines = text.splitlines()
    start = _table_header(lines)
    header = [c.upper() for c in lines[start].split()]
    vram_col = header.index("VRAM%")
    use_col = next((i for i, c in enumerate(header) if re.fullmatch(rf"{_PREFIX}%", c, re.I)), None)
    cards = []
    for line in lines[start + 1:]:
        cols = line.split()
        if not cols or not cols[0].isdigit():
            continue      # ==== rules and the end banner
        if len(cols) < len(header):
            raise ValueError(f"row {line.strip()!r} has fewer columns than the header")
        cards.append(Card(int(cols[0]), vram_pct=_number(cols[vram_col]),
                          util_pct=_number(cols[use_col]) if use_col is not None else None))
    return sorted(cards, key=lambda c: c.index)


def _parse_csv(text: str) -> list[Card]:
    """nvidia-smi --query-gpu=... --format=csv[,noheader][,nounits]; without a header, NVIDIA_FIELDS order."""
    rows = [[c.strip() for c in row] for row in csv.reader(io.StringIO(text)) if any(c.strip() for c in row)]
    if rows and not _number_or_none(rows[0][0]):
        names = [re.sub(r"\s*\[.*\]$", "", c).strip().lower() for c in rows[0]]
        rows = rows[1:]
    else:
        names = list(NVIDIA_FIELDS)
    if "index" not in names:
        raise ValueError("no index column")
    cards = []
    for row in rows:
        if len(row) != len(names):
            raise ValueError(f"row {','.join(row)!r} does not match the columns {','.join(names)}")
        f = dict(zip(names, row))
        used = _number(f["memory.used"]) if "memory.used" in f else None
        total = _number(f["memory.total"]) if "memory.total" in f else None
        cards.append(Card(int(_number(f["index"])), NAN if used is None else used,
                          NAN if total is None else total,
                          _number(f["utilization.gpu"]) if "utilization.gpu" in f else None))
    return sorted(cards, key=lambda c: c.index)


def _number_or_none(value: str) -> bool:
    try:
        return _number(value) is not None
    except ValueError:
        return False


# --- on a host ----------------------------------------------------------------------------------

MARKER = "fleet-smi: "
OTHER_MARKER = "fleet-smi-other: "
SMI_KINDS = ("dcu", "rocm", "nvidia")      # the kinds whose cards an smi binary reports


def smi_command(hv) -> str:
    """A bash line that finds the host's smi, prints `fleet-smi: PATH`, then runs it with SMI_ARGS."""
    d = hv.settings.deploy_dir
    wanted = hv.settings.smi
    if hv.settings.accelerator == "sim" and not wanted:
        py = hv.settings.python or "python3"
        return (f"echo {shlex.quote(MARKER + 'sim')}; "
                f"PYTHONPATH={shlex.quote(layout.path(d, layout.LIB))}${{PYTHONPATH:+:$PYTHONPATH}} "
                f"exec {shlex.quote(py)} -m fleet.sim smi --dev-dir {shlex.quote(layout.path(d, layout.SIM_DEV))} --showuse")
    if hv.settings.accelerator == "cpu" and not wanted:
        spec = {"deploy_dir": d, "deployment_id": hv.deployment_id, "instances": hv.settings.instances}
        return (f"echo {shlex.quote(MARKER + 'cpu')}\n" + agent.python_command(
            hv, f"-c {shlex.quote(hostcode.probe('cpu_mem'))} {shlex.quote(json.dumps(spec))}"))
    candidates = [wanted] if wanted else list(accelerators.kind(hv.settings.accelerator).smi_candidates)
    cases = " ".join(f"{name}) set -- {shlex.join(args)} ;;" for name, args in SMI_ARGS.items())
    # None of the kind's own: name another kind's smi when one is there (a host whose accelerator is
    # the wrong kind), for the doctor to say which kind to set.
    others = [] if wanted else other_kinds_smis(hv.settings.accelerator)
    look = (f"for c in {shlex.join(others)}; do p=$(command -v \"$c\" 2>/dev/null) && "
            f'echo "{OTHER_MARKER}$p" >&2; done; ') if others else ""
    return (f"for c in {shlex.join(candidates)}; do "
            f'p=$(command -v "$c" 2>/dev/null) || continue; '
            f'case "${{p##*/}}" in {cases} *) set -- ;; esac; '
            f'echo "{MARKER}$p"; exec "$p" "$@"; done; ' + look +
            f"echo 'no smi found (looked for {' '.join(candidates)})' >&2; exit 127")


def other_kinds_smis(kind: str) -> list[str]:
    """The smi candidates of the card kinds other than kind (dcu, rocm, nvidia), minus kind's own."""
    own = set(accelerators.kind(kind).smi_candidates) if kind in SMI_KINDS else set()
    return [c for k in SMI_KINDS if k != kind for c in accelerators.kind(k).smi_candidates if c not in own]


def kind_of_smi(path: str) -> str | None:
    """The accelerator kind an smi binary belongs to, by its name (rocm-smi: rocm, though a DCU has it too)."""
    return {"hy-smi": "dcu", "rocm-smi": "rocm", "nvidia-smi": "nvidia"}.get(path.rsplit("/", 1)[-1])


def found_other_smis(output: str) -> list[str]:
    """The other kinds' smis smi_command found when the host's kind had none."""
    return list(dict.fromkeys(ln[len(OTHER_MARKER):].strip() for ln in output.splitlines()
                              if ln.startswith(OTHER_MARKER)))


def locate_note(hv) -> str:
    """Where read_cards looks for the smi, for messages."""
    if hv.settings.smi:
        return hv.settings.smi
    if hv.settings.accelerator in ("sim", "cpu"):
        return KIND_TOOL[hv.settings.accelerator]
    return ", ".join(accelerators.kind(hv.settings.accelerator).smi_candidates)


def parse_output(hv, stdout: str) -> list[Card]:
    """Parse what smi_command printed: the marker line names the tool, the rest is its output."""
    lines = stdout.splitlines()
    tool = hv.settings.accelerator
    if lines and lines[0].startswith(MARKER):
        tool = lines[0][len(MARKER):].strip()
        tool = KIND_TOOL.get(tool, tool) if tool in ("sim", "cpu") else tool
        lines = lines[1:]
    return parse(tool, "\n".join(lines))


def read_cards(conn, hv) -> list[Card]:
    """Run the accelerator's smi on the host through the transport and parse it (hv prepared)."""
    r = conn.run(smi_command(hv), timeout=60)
    if r.exited == 127 and MARKER not in r.stdout:
        raise SmiNotFound(f"{hv.name}: no smi found on the host (looked for {locate_note(hv)}); install it "
                          "or name it with the inventory key smi.")
    if not r.ok:
        tool = next((ln[len(MARKER):] for ln in r.stdout.splitlines() if ln.startswith(MARKER)), locate_note(hv))
        why = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines()[-1:] or ["no output"])[-1]
        raise RemoteError(f"{hv.name}: `{tool}` failed (exit {r.exited}): {why[:200]}")
    try:
        return parse_output(hv, r.stdout)
    except SmiError as e:
        raise SmiError(f"{hv.name}: {e}") from None
