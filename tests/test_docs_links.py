"""Every relative link in the docs (README.md, docs/**/*.md, scripts/README.md) names a file or folder that
exists: a link into what left the tree (git keeps it) is written as a path at a commit, not as a link. The
part after `#` is not checked, nor links with a scheme (http:, mailto:). Links inside code are not links."""
import re
from pathlib import Path
from urllib.parse import unquote

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.S | re.M)   # fenced code blocks
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)                      # `inline code`, ``with ` inside``
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")   # [text](target)
REFERENCE = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)  # [name]: target
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def doc_files() -> list[Path]:
    return [ROOT / "README.md", ROOT / "scripts" / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def relative_links(text: str) -> list[str]:
    """The relative targets of a markdown text's links, without their #fragment (code stripped first)."""
    text = CODE_SPAN.sub("", FENCE.sub("", text))
    targets = INLINE.findall(text) + REFERENCE.findall(text)
    return [unquote(t.split("#", 1)[0]) for t in targets if t and not SCHEME.match(t) and not t.startswith("#")]


def broken_links(path: Path) -> list[str]:
    return [t for t in relative_links(path.read_text(encoding="utf-8")) if not (path.parent / t).exists()]


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path):
    broken = broken_links(path)
    assert broken == [], f"{path.relative_to(ROOT)} links to paths that do not exist: {broken}"


def test_the_check_finds_a_broken_link(tmp_path):
    (tmp_path / "there.md").write_text("x")
    page = tmp_path / "page.md"
    page.write_text("[ok](there.md#part) [gone](results/gone/README.md) [web](https://example.com/x) [top](#a)\n"
                    "![plot](img/missing.png) `[code](not/a/link.md)`\n\n```\n[fenced](nor/this.md)\n```\n"
                    "[ref]: ./also-gone.md\n")
    assert broken_links(page) == ["results/gone/README.md", "img/missing.png", "./also-gone.md"]
