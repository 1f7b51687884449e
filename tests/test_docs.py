"""The docs stay true: the inventory reference is the schema's, and every relative link leads somewhere."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fleet import schema_doc

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted(p.relative_to(ROOT) for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def test_inventory_reference_is_generated_from_the_schema():
    written = (ROOT / "docs" / "inventory.md").read_text()
    assert written == schema_doc.markdown(), (
        "docs/inventory.md differs from the schema's reference: run "
        "`python -m fleet.schema_doc > docs/inventory.md`")


def test_every_key_of_the_schema_is_documented():
    """Every key the schema takes (nested keys dotted) has its text and its heading in the reference."""
    text = schema_doc.markdown()
    for _, key, info in schema_doc.keys():
        assert (info.json_schema_extra or {}).get("doc"), f"{key}: add doc() text in fleet/schema.py"
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
