"""What a run did on one host: its steps (ok, changed, skipped, failed) and the Ansible-style recap."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

Emit = Callable[[str], None]


@dataclass
class Step:
    """One thing a run did or found: status is ok, changed, skipped or failed."""

    name: str
    status: str
    message: str = ""

    def line(self) -> str:
        """The step as a run's output says it: `changed: proxy: reloaded ...`."""
        return f"{self.status}: {self.name}: {self.message}"


@dataclass
class Report:
    """What a run did on one host: its steps, and the host's status at the end when known."""

    host: str
    steps: list[Step] = field(default_factory=list)
    unreachable: str | None = None
    status: Any = None          # fleet.facts.state.Status, the host's `inv status` (this module sits below it)
    data: dict = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)   # said beside the recap; they fail nothing

    def add(self, name: str, status: str, message: str = "") -> Step:
        step = Step(name, status, message)
        self.steps.append(step)
        return step

    def warn(self, message: str) -> None:
        """Something the run did not fail on, but the operator must know: a line beside the recap."""
        if message not in self.warnings:
            self.warnings.append(message)

    def count(self, status: str) -> int:
        return sum(1 for s in self.steps if s.status == status)

    @property
    def failed(self) -> bool:
        return self.count("failed") > 0

    def recap(self) -> str:
        """The Ansible-style recap line."""
        return (f"{self.host} : ok={self.count('ok')} changed={self.count('changed')} "
                f"skipped={self.count('skipped')} failed={self.count('failed')} "
                f"unreachable={1 if self.unreachable else 0}")
