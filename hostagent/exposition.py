"""Prometheus' text exposition format, read: the host agent's one parser of a /metrics text.

The keeper, the drain and the live view's sampler read engines' and the proxy's /metrics through it; the
sampler sends what it parsed (numbers), so the control plane parses no exposition text. Standard library
only, Python 3.6+ (the probes bundle it, fleet.transport.hostcode).
"""
import re

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def samples(text, names=None):
    """[(name, labels, value)] of the sample lines of a /metrics text (comments and unreadable lines
    skipped); names: keep only these metrics (a histogram's buckets are `<name>_bucket`)."""
    out = []
    for line in text.splitlines():
        if not line or line[0] == "#":
            continue
        m = _SAMPLE.match(line)
        if not m or (names is not None and m.group(1) not in names):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        out.append((m.group(1), dict(_LABEL.findall(m.group(2) or "")), value))
    return out


def total(found, *names):
    """The sum of the samples of names (over all their labels); None when there is none."""
    values = [v for name, _, v in found if name in names]
    return sum(values) if values else None
