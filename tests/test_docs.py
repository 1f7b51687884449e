"""The docs stay true: the inventory reference is the schema's, and every relative link leads somewhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleet.settings import schema_doc

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(p.relative_to(ROOT) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_inventory_reference_is_generated_from_the_schema():
    written = (ROOT / "docs" / "inventory.md").read_text()
    assert written == schema_doc.markdown(), (
        "docs/inventory.md differs from the schema's reference: run "
        "`python -m fleet.settings.schema_doc > docs/inventory.md`")


def test_every_key_of_the_schema_is_documented():
    """Every key the schema takes (nested keys dotted) has its text and its heading in the reference."""
    text = schema_doc.markdown()
    for _, key, info in schema_doc.keys():
        assert (info.json_schema_extra or {}).get("doc"), f"{key}: add doc() text in fleet/settings/schema.py"
        assert f"#### `{key}`" in text


def _anchors(markdown: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to dashes, repeats numbered."""
    seen: dict[str, int] = {}
    out = set()
    for line in re.sub(r"```.*?```", "", markdown, flags=re.S).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def _links(path: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", (ROOT / path).read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_relative_links_lead_to_files_and_headings_that_exist(doc):
    broken = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        dest = (ROOT / doc).parent / file if file else ROOT / doc
        if not dest.exists():
            broken.append(f"{target} (no file {dest.relative_to(ROOT)})")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest.read_text()):
            broken.append(f"{target} (no heading #{anchor} in {dest.relative_to(ROOT)})")
    assert not broken, f"{doc}: broken links: " + ", ".join(broken)


# --- the settings a running proxy keeps until it restarts -----------------------------------------

PROXY_TEMPLATE = ROOT / "fleet" / "templates" / "proxy.yaml.j2"
INVENTORY_KEY = re.compile(r"(?<![/\w.])proxy\.[a-z_]+(?:\.[a-z_]+)*")


def _template_blocks() -> dict[str, set[str]]:
    """conf/proxy.yaml's top-level keys, each with the inventory keys (`proxy.*`) its template lines use."""
    blocks: dict[str, set[str]] = {}
    key = None
    for line in PROXY_TEMPLATE.read_text().splitlines():
        m = re.match(r"([a-z_]+):", line)
        if m:
            key = m.group(1)
        elif not line.startswith((" ", "\t")):
            key = None     # a comment or a template tag at the margin ends the block
        if key is not None:
            blocks.setdefault(key, set()).update(INVENTORY_KEY.findall(line))
    return blocks


def restart_only_keys() -> dict[str, str]:
    """The inventory keys behind proxy.state.RESTART_ONLY, read from the template that renders them:
    inventory key -> the setting of conf/proxy.yaml it renders."""
    from proxy.state import RESTART_ONLY
    blocks = _template_blocks()
    keys = {}
    for setting in RESTART_ONLY:
        assert blocks.get(setting), f"{setting} (proxy.state.RESTART_ONLY) renders from no proxy.* key"
        keys.update(dict.fromkeys(blocks[setting], setting))
    return keys


def _restart_lists(text: str, keys: dict[str, str]) -> list[set[str]]:
    """Each parenthesised list, in a paragraph (or table row) about restarting, that names the keys of
    two or more restart-only settings (the two keys of one, such as a log's rotation, are no such list)."""
    found = []
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    for paragraph in re.split(r"\n\s*\n|\n(?=\|)", text):
        if "restart" not in paragraph:
            continue
        for group in re.findall(r"\(([^()]*)\)", paragraph):
            named = set(re.findall(r"`(proxy\.[\w.]+)`", group))
            if len({keys[k] for k in named if k in keys}) >= 2:
                found.append(named)
    return found


def test_restart_only_settings_come_from_the_template():
    assert restart_only_keys().items() >= {("proxy.port", "listen"), ("proxy.admin_port", "admin"),
                                           ("proxy.log.max_mb", "log")}


def test_docs_list_exactly_the_settings_that_restart_the_proxy():
    """Wherever a doc lists the settings a reload cannot change, it lists proxy.state.RESTART_ONLY's."""
    keys = restart_only_keys()
    seen = 0
    for doc in DOCS:
        for named in _restart_lists((ROOT / doc).read_text(), keys):
            seen += 1
            assert named == set(keys), (f"{doc}: the settings that restart the proxy are "
                                   f"{', '.join(sorted(keys))}; it lists {', '.join(sorted(named))}")
    assert seen, "no doc lists the settings that restart the proxy (docs/proxy.md should)"


# --- docs/ARCHITECTURE.md's module tables --------------------------------------------------------

PARTS = ("fleet", "hostagent", "proxy")


def module_tables() -> dict[str, set[str]]:
    """Each part's module table in docs/ARCHITECTURE.md (the `### `part/`` sections under `## Modules`):
    part -> the names in its rows' first cells, as written (`cli.py`, `sim/`)."""
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    modules = re.search(r"^## Modules\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert modules, "docs/ARCHITECTURE.md has no `## Modules` section"
    tables: dict[str, set[str]] = {}
    for part, body in re.findall(r"^### `(\w+)/`[^\n]*\n(.*?)(?=^### |\Z)", modules.group(1), flags=re.S | re.M):
        first_cells = re.findall(r"^\| *([^|]*?) *\|", body, flags=re.M)
        tables[part] = {n for cell in first_cells for n in re.findall(r"`([^`]+)`", cell)}
    return tables


def test_the_module_tables_name_every_module_and_no_other():
    """Every module of the three parts (`__init__.py` aside) is a row of its part's table, by itself
    (`cli.py`, `probes/state.py`) or in a package named as a whole (`sim/`, `probes/`); every name
    in a table is a module or package that exists."""
    tables = module_tables()
    assert set(tables) == set(PARTS), f"docs/ARCHITECTURE.md: one module table per part, {PARTS}"
    problems = []
    for part, names in tables.items():
        base = ROOT / part
        packages = {n for n in names if n.endswith("/")}
        for n in sorted(names):
            if n.endswith("/"):
                ok = (base / n / "__init__.py").is_file() or any((base / n).glob("*.py"))
            else:
                ok = n.endswith(".py") and (base / n).is_file()
            if not ok:
                problems.append(f"`{n}` in the {part}/ table is no module or package of {part}/")
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).as_posix()
            if path.name == "__init__.py" or rel in names:
                continue
            if not any(rel.startswith(p) for p in packages):
                problems.append(f"{part}/{rel} is in no row of the {part}/ table")
    assert not problems, "docs/ARCHITECTURE.md's module tables: " + "; ".join(problems)


# --- what a reader outside the project can follow ----------------------------------------------------

# An issue or pull request of this project by its number means nothing to a reader of the docs. Another
# project's is fine when it names the repository (vllm-project/production-stack#957) or links it.
INTERNAL_NUMBER = re.compile(r"\b(?:issues?|pull requests?|PRs?)\s+#?\d+\b|(?<![\w/.-])#\d+\b(?![\w-])",
                             flags=re.I)


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_no_doc_names_an_internal_issue_number(doc):
    found = [m.group(0) for m in INTERNAL_NUMBER.finditer((ROOT / doc).read_text())]
    assert not found, f"{doc}: say what the thing is instead of its issue number: {found}"


def test_an_internal_issue_number_is_recognised_and_another_projects_is_not():
    named = [t for t in ("issue 19", "Issue 20's work", "(issue #21)", "see #12.", "PR 3",
                         "vllm-project/router#244", "production-stack/issues/957", "[x](a.md#1-setup)",
                         "engines encountered an issue")
             if INTERNAL_NUMBER.search(t)]
    assert named == ["issue 19", "Issue 20's work", "(issue #21)", "see #12.", "PR 3"]


def _repeated_headings(markdown: str) -> list[str]:
    """Headings that repeat a sibling's text: the same level under the same parent heading."""
    seen: set[tuple] = set()
    parents: list[tuple[int, str]] = []
    repeated = []
    for line in re.sub(r"```.*?```", "", markdown, flags=re.S).splitlines():
        m = re.match(r"(#{1,6}) (.*)", line)
        if not m:
            continue
        level, title = len(m.group(1)), m.group(2).strip()
        while parents and parents[-1][0] >= level:
            parents.pop()
        key = (tuple(parents), level, title)
        if key in seen:
            repeated.append(line)
        seen.add(key)
        parents.append((level, title))
    return repeated


@pytest.mark.parametrize("doc", DOCS, ids=str)
def test_no_doc_repeats_a_heading_within_a_section(doc):
    repeated = _repeated_headings((ROOT / doc).read_text())
    assert not repeated, f"{doc}: headings repeated within one section: {repeated}"


def test_a_repeated_heading_is_one_under_the_same_parent():
    text = "# A\n## x\n### y\n## z\n### y\n## x\n"
    assert _repeated_headings(text) == ["## x"]
