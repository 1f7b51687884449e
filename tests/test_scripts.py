"""The rendered shell scripts run on bash 4.2 (CentOS/RHEL 7) and are shellcheck-clean at warning level.

Every example inventory is rendered as `inv render` writes it: inventory/hosts.yml's hosts, the README's
examples, and variants that reach the templates' other branches (models on the sim and on the CPU build,
no extra_args, no env_setup, a group without LoRA).
"""
from __future__ import annotations

import re
import subprocess
import textwrap

import pytest
import yaml
from conftest import ROOT, require_tool

from fleet import render
from fleet.settings import inventory

# Hosts that reach the branches inventory/hosts.yml and the README do not: the models form on the sim
# (a group with runtime LoRA, one with nothing: empty GROUP_ENV, GROUP_ARGS and EXTRA_ARGS) and on the CPU
# build, a plain vLLM host with no extra_args and no env_setup.
VARIANTS = textwrap.dedent("""\
    sim-models:
      connection: local
      engine: sim
      accelerator: sim
      accelerators: 3
      models:
        - {name: vision, model: /m/vision, instances: 1, runtime_lora: true, aliases: [see]}
        - {name: text, model: /m/text, tensor_parallel_size: 2}
    cpu-models:
      connection: local
      engine: vllm
      accelerator: cpu
      env_setup: source ~/venvs/vllm-cpu/bin/activate
      base_port: 8102
      proxy: {port: 8100, admin_port: 8101}
      keeper: {metrics_port: 8199}
      models:
        - {name: a, model: ~/models/a, extra_args: [--dtype, bfloat16]}
        - {name: b, model: ~/models/b}
    nvidia-bare:
      connection: local
      accelerator: nvidia
      accelerators: 2
      instances: 2
      model: /data/models/m
      base_port: 8202
      proxy: {port: 8200, admin_port: 8201}
      keeper: {metrics_port: 8299}
""")


def merged(into: dict, more: dict) -> dict:
    """into with more laid over it, mappings merged key by key (as the inventory layers them)."""
    for key, value in more.items():
        into[key] = merged(dict(into[key]), value) if isinstance(value, dict) and isinstance(
            into.get(key), dict) else value
    return into


def readme_hosts() -> dict:
    """The hosts of the README's YAML examples (the NVIDIA server, the DCU server, the API keys), merged."""
    hosts: dict = {}
    for block in re.findall(r"```yaml\n(.*?)```", (ROOT / "README.md").read_text(), re.S):
        merged(hosts, (yaml.safe_load(block) or {}).get("hosts") or {})
    assert {"gpu-01", "k100-01"} <= set(hosts), "the README's examples moved: update readme_hosts"
    return hosts


@pytest.fixture(scope="module")
def scripts(tmp_path_factory) -> dict[str, str]:
    """Every rendered shell script of every example host: {"inventory host path": text}."""
    tmp = tmp_path_factory.mktemp("examples")
    extra = tmp / "examples.yml"
    extra.write_text(yaml.safe_dump({"hosts": readme_hosts()}) + textwrap.indent(VARIANTS, "  "))
    out = {}
    for path in (ROOT / "inventory" / "hosts.yml", extra):
        inv = inventory.load(path)
        for name in inv.select("all"):
            hv = render.offline(inv.host_vars(name, []), "/home/ops")
            for f in render.render_host(hv):
                if f.path.endswith(".sh"):
                    out[f"{path.name} {name} {f.path}"] = f.content
    assert len(out) >= 3 * 7
    return out


ARRAY_ASSIGN = re.compile(r"(?<![\w+])([A-Za-z_]\w*)=\(")
FILLED = re.compile(r"\b(?:read\s+(?:-\w+\s+)*-a\s+|mapfile\s+(?:-\w+\s+)*|readarray\s+(?:-\w+\s+)*)([A-Za-z_]\w*)")
EXPANSION = re.compile(r"\$\{([A-Za-z_]\w*)\[[@*]\](:?[-+])?")


def _closing(text: str, start: int, opening: str, closing: str) -> int:
    """The index of the bracket that closes the one at text[start], skipping quoted text."""
    depth, quote, i = 0, None, start
    while i < len(text):
        c = text[i]
        if quote:
            if c == "\\" and quote == '"':
                i += 1
            elif c == quote:
                quote = None
        elif c in "'\"":
            quote = c
        elif c == opening:
            depth += 1
        elif c == closing:
            depth -= 1
            if depth == 0:
                return i
        i += 1
    return len(text)


def _can_be_empty(words: str) -> bool:
    """An array's literal list can give no element: nothing in it but expansions that may vanish
    (unquoted `$(...)`, `${...}`, `$NAME`, and `"${A[@]}"`, as many words as A has)."""
    i = 0
    while i < len(words):
        if words[i].isspace():
            i += 1
        elif words.startswith(("$(", "${"), i):
            i = _closing(words, i + 1, words[i + 1], ")" if words[i + 1] == "(" else "}") + 1
        elif m := re.compile(r'\$\w+|"\$\{\w+\[@\]\}"').match(words, i):
            i = m.end()
        else:
            return False
    return True


def unguarded_array_expansions(text: str) -> list[str]:
    """`"${A[@]}"` or `${A[*]}` of an array that can be empty, not in bash 4.2's safe form
    (`${A[@]+"${A[@]}"}`, `${A[*]-}`): under `set -u`, bash before 4.4 stops there with "A[@]: unbound
    variable". An array can be empty when some assignment lists nothing that must stay a word, or when
    read -a or mapfile fills it. Each finding: "line N: the line"."""
    code = "\n".join("" if line.lstrip().startswith("#") else line for line in text.splitlines())
    maybe_empty = {m.group(1) for m in FILLED.finditer(code)}
    for m in ARRAY_ASSIGN.finditer(code):
        end = _closing(code, m.end() - 1, "(", ")")
        if _can_be_empty(code[m.end():end]):
            maybe_empty.add(m.group(1))
    guarded: list[tuple[str, int, int]] = []        # (array, start, end) of each ${A[@]+...} guard
    found = []
    for m in EXPANSION.finditer(code):
        name, op = m.group(1), m.group(2)
        if op:                                       # ${A[@]+...}, ${A[*]-...}, ${A[*]:-...}: safe
            guarded.append((name, m.start(), _closing(code, m.start() + 1, "{", "}")))
            continue
        if name not in maybe_empty or any(g == name and s < m.start() < e for g, s, e in guarded):
            continue
        line = code.count("\n", 0, m.start())
        found.append(f"line {line + 1}: {text.splitlines()[line].strip()}")
    return found


@pytest.mark.unit
def test_the_array_check_finds_the_unsafe_form_and_passes_the_safe_one():
    """1. The forms bash 4.2 stops on under set -u: an empty list, a command's output, read -a, a local.
    2. Their safe forms, and arrays that cannot be empty (a literal word in every assignment), pass."""
    unsafe = textwrap.dedent("""\
        EXTRA_ARGS=()
        GROUP_ENV=()
        CPUS=($(seq 0 $(($(nproc) - 1))))
        read -r -a F <<<"$line"
        f() { local x=() y=(--flag "$1"); echo "${x[*]}" "${y[@]}"; }
        env "${GROUP_ENV[@]}" setsid "${ENGINE[@]}" "${EXTRA_ARGS[@]}"
        echo "${CPUS[*]:0:1}" ${F[@]}
        # a comment may say "${EXTRA_ARGS[@]}"
        """)
    assert unguarded_array_expansions(unsafe) == [
        'line 5: f() { local x=() y=(--flag "$1"); echo "${x[*]}" "${y[@]}"; }',
        'line 6: env "${GROUP_ENV[@]}" setsid "${ENGINE[@]}" "${EXTRA_ARGS[@]}"',
        'line 6: env "${GROUP_ENV[@]}" setsid "${ENGINE[@]}" "${EXTRA_ARGS[@]}"',
        'line 7: echo "${CPUS[*]:0:1}" ${F[@]}',
        'line 7: echo "${CPUS[*]:0:1}" ${F[@]}']
    safe = textwrap.dedent("""\
        EXTRA_ARGS=()
        ENGINE=(vllm serve "$MODEL")
        CPUS=($(seq 0 0))
        args=(--served-model-name "${NAMES[@]}" --host "$BIND")
        env ${EXTRA_ARGS[@]+"${EXTRA_ARGS[@]}"} "${ENGINE[@]}" "${args[@]}"
        [ -n "${EXTRA_ARGS[*]-}" ] && echo "${#CPUS[@]}" "${CPUS[*]+${CPUS[*]:0:1}}"
        """)
    assert unguarded_array_expansions(safe) == []


@pytest.mark.unit
def test_no_rendered_script_expands_an_array_that_can_be_empty_without_the_guard(scripts):
    """1. Render every example host's scripts (the README's NVIDIA example renders `EXTRA_ARGS=()`, a
       models group without LoRA `GROUP_ENV=()`).
    2. Each expansion of an array that can be empty is in the form bash 4.2 accepts under set -u."""
    found = {name: bad for name, text in scripts.items() if (bad := unguarded_array_expansions(text))}
    assert found == {}


@pytest.mark.unit
def test_every_rendered_script_is_shellcheck_clean_at_warning_level(scripts, tmp_path):
    """1. Write every example host's rendered scripts to files.
    2. `shellcheck -S warning` (Debian's) finds nothing in any of them."""
    shellcheck = require_tool("shellcheck")
    paths = []
    for i, (name, text) in enumerate(sorted(scripts.items())):
        p = tmp_path / f"{i:02d}-{name.replace(' ', '-').replace('/', '-')}"
        p.write_text(text)
        paths.append(str(p))
    r = subprocess.run([shellcheck, "-S", "warning", *paths], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
