"""The README and docs/ as a reader meets them: every ```python block runs, every relative link lands, and every
benchmark number on the performance pages is one benchmarks/tables.py writes from the CSVs.

A block that cannot run here (a GPU, several ranks, a hub download, a fragment of a larger script) carries an HTML
comment on the line before its fence, `<!-- not run: why -->`; it must still compile. Every other block runs, in one
subprocess for all of them (imports paid once), each block in a fresh namespace with every patch reverted after it.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
import unicodedata
from dataclasses import dataclass
from pathlib import Path

import pytest
from entrypoints import REPO, benchmarks_importable

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
NOT_RUN = re.compile(r"<!--\s*not run:\s*\S.*-->")
FENCE = re.compile(r"^(`{3,})(\w*)\s*$")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int  # 1-based line of the opening fence
    code: str
    skip: str  # why it is not run ("" when it runs)

    @property
    def name(self) -> str:
        return f"{self.page.relative_to(REPO)}:{self.line}"


def blocks(page: Path, lang: str = "python") -> list[Block]:
    out: list[Block] = []
    lines = page.read_text().splitlines()
    i = 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        end = next(j for j in range(i + 1, len(lines)) if lines[j].strip() == m.group(1))
        if m.group(2) == lang:
            before = next((lines[j] for j in range(i - 1, -1, -1) if lines[j].strip()), "")
            skip = NOT_RUN.search(before)
            out.append(Block(page, i + 1, "\n".join(lines[i + 1:end]) + "\n", skip.group(0) if skip else ""))
        i = end + 1
    return out


ALL = [b for page in PAGES for b in blocks(page)]
RUN = [b for b in ALL if not b.skip]
RUNNER = textwrap.dedent("""
    import json, sys, traceback
    results = {}
    for name, code in json.load(open(sys.argv[1])):
        try:
            exec(compile(code, name, "exec"), {"__name__": "__main__"})
            results[name] = ""
        except BaseException:
            results[name] = traceback.format_exc()[-3000:]
        if "patchkit" in sys.modules:
            sys.modules["patchkit"].revert_patch()
    json.dump(results, open(sys.argv[2], "w"))
""")


def test_every_page_has_its_blocks_found():
    assert len(RUN) >= 5 and any(b.page.name == "README.md" for b in RUN)


@pytest.mark.parametrize("block", [b for b in ALL if b.skip], ids=lambda b: b.name)
def test_a_block_not_run_still_compiles(block: Block):
    compile(block.code, block.name, "exec")


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> dict[str, str]:
    folder = tmp_path_factory.mktemp("docs_blocks")
    (folder / "blocks.json").write_text(json.dumps([(b.name, b.code) for b in RUN]))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PATCHKIT_")}  # a user's plain shell
    proc = subprocess.run([sys.executable, "-c", RUNNER, str(folder / "blocks.json"), str(folder / "out.json")],
                          capture_output=True, text=True, timeout=600, cwd=str(folder), env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((folder / "out.json").read_text())


@pytest.mark.heavy  # starts Python processes: make test-heavy
@pytest.mark.parametrize("block", RUN, ids=lambda b: b.name)
def test_a_python_block_runs(ran: dict[str, str], block: Block):
    assert ran[block.name] == "", f"{block.name} raised:\n{ran[block.name]}"


# Links: [text](target) outside code; a target with a scheme is external and not followed.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def prose(page: Path) -> str:
    """The page without fenced blocks and inline code spans (links there are examples, not links)."""
    text = re.sub(r"^(`{3,}).*?^\1\s*$", "", page.read_text(), flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def slug(heading: str) -> str:
    """Python-Markdown's toc slug (what mkdocs makes a heading's id)."""
    text = unicodedata.normalize("NFKD", heading.replace("`", "")).encode("ascii", "ignore").decode()
    text = re.sub(r"[^\w\s-]", "", text).strip().lower()
    return re.sub(r"[-\s]+", "-", text)


def anchors(page: Path) -> set[str]:
    """The ids of a page's headings (fenced blocks left out: a `# comment` there is no heading)."""
    text = re.sub(r"^(`{3,}).*?^\1\s*$", "", page.read_text(), flags=re.S | re.M)
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_lands(page: Path):
    broken = []
    for target in LINK.findall(prose(page)):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif page.parent.name == "docs" and REPO / "docs" not in dest.parents:
            broken.append(f"{target}: outside docs/, so not on the site")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


def test_every_docs_page_is_in_the_site_nav():
    nav = (REPO / "mkdocs.yml").read_text()
    assert [p.name for p in PAGES[1:] if f" {p.name}" not in nav] == []


@pytest.fixture(scope="module")
def tables():
    with benchmarks_importable():
        import tables as module

        yield module


@pytest.mark.parametrize("name", ["docs/performance.md", "README.md"])
def test_benchmark_tables_are_the_csvs(tables, name: str):
    """Rewrite with `python benchmarks/tables.py` after a benchmark writes new CSVs."""
    text = (REPO / name).read_text()
    assert "<!-- table:" in text and tables.render(text) == text


def test_the_performance_prose_quotes_no_ratio_of_its_own(tables):
    """A ratio on the performance page sits in a table the CSVs write, never in the prose around them."""
    text = tables.MARKED.sub("", (REPO / "docs" / "performance.md").read_text())
    assert re.findall(r"\d+(?:\.\d+)?x\b", text) == []


def test_the_causes_table_names_every_cause_patchkit_steps_aside_for():
    """docs/never-silently-wrong.md's table of causes is the one a warning's cause name leads a reader to: it holds
    every cause in `hooks/decide/causes.py`, and no other."""
    from patchkit.hooks.decide.causes import BRIEF, CAUSES

    text = (REPO / "docs" / "never-silently-wrong.md").read_text()
    section = text.split("## The causes", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| `(\w+)` \|", section, flags=re.M)
    assert len(rows) == len(set(rows)), rows
    assert sorted(rows) == sorted(CAUSES) == sorted(BRIEF)
