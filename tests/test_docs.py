"""The README is a front page and the reference in ``docs/`` builds: MkDocs builds it with ``--strict`` (no broken
link, anchor or nav entry), every relative link in the README and the pages resolves to a file and heading, the
README stays under 150 lines and links every page, and every command in a fenced block of the README is checked
here or marked with the reason it cannot be (``<!-- needs: device -->`` on the line before the block).

``tests/test_readme_commands.py`` parses every ``sim2edge``/``sim2edge-agent`` command of the README and the pages
with the real CLIs; this file adds what the front page promises beyond that.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from markdown.extensions.toc import slugify

from tests.test_readme_commands import RUN_HERE, commands, page_commands, shell_lines

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCS = REPO / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
FENCE = re.compile(r"^\s*(```+|~~~+)")
NEEDS = re.compile(r"^\s*<!--\s*needs:\s*(.+?)\s*-->\s*$")
RUN_BY = {"sim2edge run --task examples.pendulum:Pendulum": ("tests/test_own_robot.py", "examples.pendulum:Pendulum"),
          "sim2edge run --task examples.gym_pusher:PusherReach --iterations 300": (  # at 2 iterations
              "tests/test_packaged_robots.py", "examples.gym_pusher:PusherReach")}
"""Front-page commands too slow to run here that another test runs for real: command → (test file, what it names)."""


def prose(text: str, code_spans: bool = False) -> str:
    """``text`` without fenced blocks (a ``# comment`` in a shell block is no heading) and, unless ``code_spans``,
    without inline code (a link there is no link); line numbers kept."""
    out, fence = [], None
    for line in text.splitlines():
        m = FENCE.match(line)
        if m and (fence is None or m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence)):
            fence = None if fence else m.group(1)
            out.append("")
        elif fence:
            out.append("")
        else:
            out.append(line if code_spans else re.sub(r"(`+)(?:(?!\1).)+?\1", "", line))
    return "\n".join(out)


def headings(page: Path) -> set[str]:
    """The anchors python-markdown's toc (MkDocs) gives the page's headings."""
    found = set()
    for line in prose(page.read_text(), code_spans=True).splitlines():
        m = re.match(r"^(#{1,6})\s+(.*?)\s*#*\s*$", line)
        if m:
            text = re.sub(r"`([^`]*)`", r"\1", m.group(2))
            text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
            found.add(slugify(re.sub(r"[*_]", "", text), "-"))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every markdown link and image in ``page``'s prose."""
    text = prose(page.read_text())
    found = [(text.count("\n", 0, m.start()) + 1, m.group(1))
             for m in re.finditer(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)", text)]
    found += [(text.count("\n", 0, m.start()) + 1, m.group(1)) for m in re.finditer(r'href="([^"]+)"', text)]
    return found


LINKS = [(page, line, target) for page in PAGES for line, target in links(page)
         if not re.match(r"^[a-z][a-z0-9+.-]*:", target)]  # http:, https:, mailto: are not checked here


def test_every_page_has_relative_links():
    assert {p for p, *_ in LINKS} >= {README, DOCS / "index.md"} and len(LINKS) >= 20


@pytest.mark.parametrize("page,line,target", LINKS,
                         ids=[f"{p.relative_to(REPO)}:{n}:{t}" for p, n, t in LINKS])
def test_relative_link_resolves_to_a_file_and_heading(page, line, target):
    path, _, anchor = target.partition("#")
    dest = (page.parent / path).resolve() if path else page
    where = f"{page.relative_to(REPO)}:{line}: [{target}]"
    assert dest.exists(), f"{where}: no {dest}"
    assert dest.is_relative_to(REPO), f"{where}: outside the repository"
    if anchor:
        assert dest.suffix == ".md", f"{where}: an anchor into a file that is not markdown"
        assert anchor in headings(dest), f"{where}: no heading #{anchor} in {dest.relative_to(REPO)}: {sorted(headings(dest))}"


def test_readme_is_a_front_page_under_150_lines_that_links_every_page():
    text = README.read_text()
    assert len(text.splitlines()) < 150, f"README.md has {len(text.splitlines())} lines; the reference goes to docs/"
    linked = {(README.parent / t.partition("#")[0]).resolve() for _, t in links(README)}
    missing = [p.name for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"README.md links no {missing}"
    assert "```mermaid" in text, "the picture of the chain"


def test_mkdocs_nav_lists_every_page():
    nav = re.findall(r"^\s*-\s*[^:\n]+:\s*(\S+\.md)\s*$", (REPO / "mkdocs.yml").read_text(), re.M)
    assert sorted(nav) == sorted(p.name for p in DOCS.glob("*.md"))


def test_mkdocs_builds_strict(tmp_path):
    """``make docs``: Material theme, ``--strict`` (a broken link, anchor or page outside the nav fails)."""
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-f", str(REPO / "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True, timeout=300, cwd=REPO,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    index = (tmp_path / "site" / "index.html").read_text()
    assert 'class="mermaid"' in index, "the chain diagram is not a Mermaid block"
    for page in DOCS.glob("*.md"):
        built = tmp_path / "site" / ("index.html" if page.stem == "index" else f"{page.stem}/index.html")
        assert built.exists(), built


def front_page_blocks() -> list[tuple[int, str | None, str]]:
    """(line of the command, the `needs:` reason of its block or None, command) of every command in a fenced shell
    block of the README, continuations joined and comments dropped as ``test_readme_commands`` reads them."""
    lines = README.read_text().splitlines()
    found, start, last = [], None, ""
    for n, line in enumerate(lines, 1):
        m = FENCE.match(line)
        if not m:
            if line.strip() and start is None:
                last = line
            continue
        if start is None:
            if line.strip()[len(m.group(1)):].strip() in ("bash", "sh", "console", "shell"):
                start = n
            else:  # another fence (mermaid, text, python): skip to its end
                start = -n
            continue
        if start > 0:
            needs = NEEDS.match(last)
            block = "```bash\n" + "\n".join(lines[start:n - 1]) + "\n```"
            found += [(start + k, needs.group(1) if needs else None, cmd) for k, cmd in shell_lines(block)]
        start, last = None, ""
    return found


BLOCKS = front_page_blocks()


def test_the_front_page_shows_both_commands_and_a_marked_device_block():
    shown = {" ".join(cmd.split()[:2]) for _, _, cmd in BLOCKS}
    assert {"make run", "make test"} <= shown, shown
    assert any(needs == "device" for _, needs, _ in BLOCKS)


@pytest.mark.parametrize("line,needs,command", BLOCKS, ids=[f"README.md:{n}" for n, *_ in BLOCKS])
def test_front_page_command_is_checked_or_marked(line, needs, command):
    """A ``make`` target must exist (``make -n``: ``make test`` is what CI runs; ``make run`` is ``sim2edge run``,
    which the slow tests run); a ``sim2edge`` command parses (test_readme_commands) and runs here when read-only,
    or names the test that runs it; anything else must say what it needs."""
    if needs:
        pytest.skip(f"needs: {needs} (parsed by test_readme_commands where it is a sim2edge command)")
    argv = command.split()
    if argv[0] == "make":
        r = subprocess.run(["make", "-n", *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, f"README.md:{line}: `{command}`: {r.stderr}"
        return
    parsed = {c for _, c, _, fenced in page_commands(README.read_text(), "README.md") if fenced}
    if argv[0].removeprefix(".venv/bin/") in ("sim2edge", "sim2edge-agent"):
        assert command in parsed and any(c == command for _, c, _, _ in commands()), command
        bare = " ".join([argv[0].removeprefix(".venv/bin/"), *argv[1:]])
        if tuple(argv[1:]) in RUN_HERE:
            return  # test_readme_commands runs it
        assert bare in RUN_BY, (f"README.md:{line}: `{command}` is neither run here nor by a named test: add it to "
                                f"RUN_BY or mark its block `<!-- needs: ... -->`")
        test, names = RUN_BY[bare]
        source = (REPO / test).read_text()
        assert names in source and f'"{argv[1]}"' in source, f"{test} no longer runs `{bare}`"
        return
    pytest.fail(f"README.md:{line}: `{command}` is not checked: mark its block `<!-- needs: ... -->` or check it here")
