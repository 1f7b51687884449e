"""What a host serves: its groups (one served model each), their instances and the cards each holds.

A host's `models:` list declares its groups; a key a group leaves unset takes the host's value. A host
without `models:` has one implicit group built from its own keys (`model`, `served_model_name`,
`instances`...). Instances are numbered over the whole host, group by group (instance i listens on
`base_port + i`); cards are handed out in the same order, `tensor_parallel_size` consecutive cards per
instance.

A host is *plain* when it has one group on one card per instance with no alias and no adapter: then every
rendered file is exactly what it was before groups existed, and the proxy takes every request whatever its
`model`. Anything else is the *models* form: the proxy routes by the body's `model`, one pool per group.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from fleet.errors import InventoryError
from fleet.settings.schema import HostSettings, ModelGroup

# A group's keys that fall back to the host's own when the group leaves them unset.
INHERITED = ("model", "tensor_parallel_size", "max_num_seqs", "max_model_len", "gpu_memory_utilization",
             "enforce_eager", "extra_args", "aliases", "lora_modules", "max_loras", "max_lora_rank",
             "runtime_lora")

# Flags in extra_args that an inventory key says instead: two sources of one setting would disagree.
OWNED_FLAGS = {
    "--tensor-parallel-size": "tensor_parallel_size",
    "-tp": "tensor_parallel_size",
    "--served-model-name": "name (or served_model_name) and aliases",
    "--lora-modules": "lora_modules",
    "--otlp-traces-endpoint": "otlp_traces_endpoint",
}


@dataclass(frozen=True)
class Group:
    """One served model: its names, its engine settings and the instances that serve it."""

    name: str
    model: str
    first: int                       # the host-wide index of its first instance
    instances: int
    tensor_parallel_size: int
    max_num_seqs: int
    max_model_len: int
    gpu_memory_utilization: float
    enforce_eager: bool
    extra_args: tuple[str, ...]
    aliases: tuple[str, ...] = ()
    lora_modules: dict = field(default_factory=dict)
    max_loras: int | None = None
    max_lora_rank: int | None = None
    runtime_lora: bool = False

    @property
    def indexes(self) -> range:
        """The host-wide indexes of its instances."""
        return range(self.first, self.first + self.instances)

    @property
    def served_names(self) -> list[str]:
        """`--served-model-name`'s values: the served name first (the one answers carry), then the aliases."""
        return [self.name, *self.aliases]

    @property
    def names(self) -> list[str]:
        """Every name a request may give to reach it: the served name, the aliases, the static adapters."""
        return [self.name, *self.aliases, *self.lora_modules]

    @property
    def lora(self) -> bool:
        """True when its engines are started with LoRA on (static adapters or runtime loading)."""
        return bool(self.lora_modules) or self.runtime_lora

    def engine_flags(self) -> list[str]:
        """The vLLM flags of the group beyond the per-instance ones: tensor parallel and LoRA."""
        flags: list[str] = []
        if self.lora_modules:          # takes one or more values: --enable-lora after it ends them
            flags += ["--lora-modules", *(f"{n}={p}" for n, p in self.lora_modules.items())]
        if self.lora:
            flags.append("--enable-lora")
        if self.tensor_parallel_size > 1:
            flags += ["--tensor-parallel-size", str(self.tensor_parallel_size)]
        if self.max_loras is not None:
            flags += ["--max-loras", str(self.max_loras)]
        if self.max_lora_rank is not None:
            flags += ["--max-lora-rank", str(self.max_lora_rank)]
        return flags


def slots(max_num_seqs: int, headroom: int) -> int:
    """The slots a proxy gives one backend: the sequences its engine runs at once (max_num_seqs), plus the
    proxy's headroom (proxy.queue.headroom). The one spelling of the rule."""
    return max_num_seqs + headroom


def seqs(slots_: int, headroom: int) -> int:
    """The max_num_seqs behind a backend's slots (slots() undone)."""
    return slots_ - headroom


def _served_name(model: str) -> str:
    return os.path.basename(model.rstrip("/")) or model


def groups_of(v: HostSettings, where: str) -> list[Group]:
    """The host's groups from its merged settings (`where`: `FILE: hosts.NAME` for errors)."""
    declared = v.models
    entries = declared if declared is not None else [
        ModelGroup.model_construct(name=v.served_model_name, instances=v.instances)]
    if declared is not None and not declared:
        raise InventoryError(f"{where}.models: an empty list; give at least one group or drop the key.")
    groups: list[Group] = []
    first = 0
    for n, entry in enumerate(entries):
        at = f"{where}.models[{n}]" if declared is not None else where
        # A key the group leaves unset takes the host's value.
        e = entry.model_copy(update={k: getattr(v, k) for k in INHERITED if getattr(entry, k) is None})
        model = e.model or ("sim-model" if v.engine == "sim" else "")
        if v.engine == "vllm" and not model:
            raise InventoryError(f"{at}.model: the vllm engine needs a model path; set model.")
        _check_extra_args(e.extra_args, at)
        if e.tensor_parallel_size > 1 and v.accelerator == "cpu":
            raise InventoryError(
                f"{at}.tensor_parallel_size: {e.tensor_parallel_size} on accelerator cpu; the toolkit "
                "gives a cpu instance its own cores, not several ranks; use tensor_parallel_size 1 there.")
        groups.append(Group(
            name=e.name or _served_name(model), model=model, first=first, instances=e.instances,
            tensor_parallel_size=e.tensor_parallel_size, max_num_seqs=e.max_num_seqs,
            max_model_len=e.max_model_len, gpu_memory_utilization=e.gpu_memory_utilization,
            enforce_eager=e.enforce_eager, extra_args=tuple(e.extra_args), aliases=tuple(e.aliases),
            lora_modules=dict(e.lora_modules), max_loras=e.max_loras, max_lora_rank=e.max_lora_rank,
            runtime_lora=e.runtime_lora))
        first += groups[-1].instances
    _check_names(groups, where)
    return groups


def _check_extra_args(extra_args, at: str) -> None:
    for arg in extra_args:
        flag = str(arg).split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise InventoryError(f"{at}.extra_args: {flag} is set by the key {OWNED_FLAGS[flag]}; "
                                 "use that key instead.")


def _check_names(groups: list[Group], where: str) -> None:
    """No name (served name, alias or adapter) may reach two groups, or one group twice."""
    owner: dict[str, int] = {}
    for n, g in enumerate(groups):
        for name in g.names:
            if name in owner:
                whose = f"twice in group {n} ({g.name})" if owner[name] == n else \
                    f"by groups {owner[name]} ({groups[owner[name]].name}) and {n} ({g.name})"
                raise InventoryError(f"{where}.models: the name {name!r} is used {whose} (served names, aliases "
                                     "and adapters route requests, so each names one group); rename one.")
            owner[name] = n


def is_plain(groups: list[Group]) -> bool:
    """One group, one card per instance, no alias, no adapter: the form every file had before groups."""
    return len(groups) == 1 and not any(
        g.tensor_parallel_size > 1 or g.aliases or g.lora for g in groups)


def assign_cards(groups: list[Group], accelerators: int, accelerator: str, where: str) -> list[tuple[int, ...]]:
    """Each instance's cards, in order: group by group, instance by instance, T consecutive cards each.
    Refuses more cards than the host has (accelerator cpu has none: instance i is "card" i, its cores)."""
    cards: list[tuple[int, ...]] = []
    for g in groups:
        for _ in g.indexes:
            start = sum(len(c) for c in cards)
            cards.append(tuple(range(start, start + g.tensor_parallel_size)))
    needed = sum(len(c) for c in cards)
    if accelerator != "cpu" and needed > accelerators:
        if is_plain(groups):
            raise InventoryError(
                f"{where}.instances: {len(cards)} instances but the host has {accelerators} accelerators "
                "(one instance per card); lower instances or raise accelerators.")
        parts = ", ".join(f"{g.name} {g.instances} x {g.tensor_parallel_size}" for g in groups)
        raise InventoryError(
            f"{where}.models: the instances need {needed} cards ({parts}: instances x tensor_parallel_size) "
            f"but the host has {accelerators} accelerators; lower instances or tensor_parallel_size, or "
            "raise accelerators.")
    return cards
