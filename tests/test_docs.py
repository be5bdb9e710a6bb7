"""The documents against the code and against each other: README's first screen, the
Communicator's signature in docs/CONTRACT.md, cross-references between documents, the
layer tables, links to every document."""
from __future__ import annotations

import inspect
import re
from pathlib import Path

import sparkccl

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
DOCS = {p.name: p.read_text() for p in (ROOT / "docs").glob("*.md")}


def _section(text: str, heading: str) -> str:
    """The body of the section under ``heading`` (a markdown heading line), up to the next
    heading of the same or a higher level."""
    m = re.search(rf"^(#+) {re.escape(heading)}\n", text, re.M)
    assert m, heading
    level = len(m.group(1))
    end = re.compile(rf"^#{{1,{level}}} ", re.M).search(text, m.end())
    return text[m.end():end.start() if end else len(text)]


def _headings(text: str) -> set[str]:
    return set(re.findall(r"^#+ (.+)$", text, re.M))


def test_readme_starts_with_one_sentence_and_the_two_commands():
    title, rest = README.split("\n", 1)
    assert title == "# sparkccl"
    intro, block, after = rest.split("```", 2)
    assert len([p for p in intro.split("\n\n") if p.strip()]) == 1  # one sentence
    assert intro.strip().count(". ") == 0 and intro.strip().endswith(".")
    commands = [ln.split("#")[0].strip() for ln in block.splitlines()[1:] if ln.strip()]
    assert commands == ['pip install torch==2.13.0 . && sparkccl demo',
                        'pip install torch==2.13.0 -e ".[test]" && python3 -m pytest -q']
    # The wheel details come later, under Install, and the first screen points there.
    first_screen = after.split("\n## ", 1)[0]
    assert "index-url" not in first_screen and "[Install](#install)" in first_screen
    assert "download.pytorch.org/whl/cpu" in _section(README, "Install")


def test_readme_use_snippet_says_what_to_write_without_a_gpu():
    code = _section(README, "Use").split("```python", 1)[1].split("```", 1)[0]
    assert 'device="cuda"' not in code.replace(" ", "") or 'device="cpu"' in code
    assert 'device="cpu"' in code


def test_contract_signature_is_the_communicators():
    text = _section(DOCS["CONTRACT.md"], "2. Communicators")
    sig = re.search(r"`Communicator\((.*?)\)`", text, re.S).group(1)
    documented = [p.split("=")[0].strip() for p in sig.replace("\n", " ").split(",")
                  if p.strip() not in ("*",)]
    actual = [n for n in inspect.signature(sparkccl.Communicator.__init__).parameters
              if n != "self"]
    assert documented == actual


def test_references_to_readme_sections_name_real_headings():
    headings = _headings(README)
    for name, text in DOCS.items():
        for ref in re.findall(r'README(?:\.md)?\s+\("([^"]+)"\)', text):
            assert ref in headings, (name, ref)


def test_layer_tables_agree():
    arch = DOCS["ARCHITECTURE.md"]
    built = _section(README, "How it is built").split("\n### ")[0]

    def rows(text):
        table = [ln for ln in text.splitlines() if ln.startswith("| ")]
        return table[2:]  # (header and rule)

    for text in (arch, built):
        assert "Five layers" in text
        assert [r.split("|")[1].strip().split(".")[0] for r in rows(text)] == \
            ["1", "2", "3", "4", "5"], text


def test_every_document_is_linked_from_the_readme():
    for name in DOCS:
        assert f"docs/{name}" in README, name


def test_gb10_projection_says_where_outside_figures_stand():
    text = DOCS["GB10_PROJECTION.md"]
    assert "VM" not in text
    quoted = text[text.index("quoted from outside this repository"):]
    flat = " ".join(quoted.split())
    assert "not recorded in this repository" in flat and "neither was reproduced here" in flat
    assert "187 Gb/s" in quoted and "4.87 ms" in quoted  # (after the caveat, not before)
    assert "187 Gb/s" not in text[:text.index("quoted from outside this repository")]
