"""docs/algorithm.md is the algorithm's one home: every citation of it in the package, the docs
and the README names one of its sections, and the package cites no document it does not ship.
Static: the files are read, nothing is imported."""

import pathlib
import re

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "algorithm.md"
CITATION = re.compile(r"algorithm\.md#([\w-]+)")  # docs/algorithm.md#x, or algorithm.md#x within docs/


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors() -> set[str]:
    return {slug(line.lstrip("#")) for line in DOC.read_text().splitlines() if line.startswith("#")}


def test_slug_follows_github():
    assert slug("HAPPO's sequential correction") == "happos-sequential-correction"
    assert slug("Flex-MG: the team as a Markov game") == "flex-mg-the-team-as-a-markov-game"
    assert slug("KL: early stop, no penalty") == "kl-early-stop-no-penalty"


def test_every_citation_names_a_section():
    known = anchors()
    sources = [*(REPO / "marft_jax").rglob("*.py"), *(REPO / "docs").glob("*.md"), REPO / "README.md"]
    cited, bad = set(), []
    for path in sources:
        for n, line in enumerate(path.read_text().splitlines(), 1):
            for anchor in CITATION.findall(line):
                cited.add(anchor)
                if anchor not in known:
                    bad.append(f"{path.relative_to(REPO)}:{n}: #{anchor}")
    internal = re.findall(r"\]\(#([\w-]+)\)", DOC.read_text())
    bad += [f"docs/algorithm.md: link #{a}" for a in internal if a not in known]
    assert len(cited) >= 15, sorted(cited)
    assert not bad, "citations of sections docs/algorithm.md does not have:\n" + "\n".join(bad)


def test_the_package_cites_no_document_it_does_not_ship():
    bad = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
           for path in (REPO / "marft_jax").rglob("*.py")
           for n, line in enumerate(path.read_text().splitlines(), 1)
           if "§" in line or "marft-reference" in line or "/work/shared" in line]
    assert not bad, "\n".join(bad)
