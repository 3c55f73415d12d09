"""The documentation's references hold (CPU only, no build needed).

- No tracked file cites the retired contract file (the name is built below, so that this file does
  not cite it either); the contract lives in docs/.
- Every ``docs/<page>.md`` or ``docs/<page>.md#<anchor>`` cited by a tracked file names an existing
  page and, with an anchor, a heading of that page producing it (GitHub's slugs).
- Every relative Markdown link of the README and of docs/ names an existing file (and anchor).
- No tracked file cites a Markdown file the repository does not hold: every Markdown link to a
  ``.md`` file in a tracked ``.md`` file, and every bare mention of a document named in capitals
  (the README, RESULTS and LOG kind, with or without a relative path) in any tracked text file,
  resolves to a file of the repository (a document kept outside it must be brought in, as
  docs/performance.md was).
- The README's Quick start code block holds exactly two commands (they are run from a fresh clone).
"""

from __future__ import annotations

import os
import re
import subprocess
from functools import lru_cache

import pytest

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))
RETIRED = "OPS" + ".md"

# docs/<path>.md with an optional #anchor, not inside a longer path or URL (".../docs/...").
DOC_REF = re.compile(r"(?<![\w./-])(docs/[\w./-]*?\.md)(#[\w-]+)?")
# A Markdown link's target: [text](target) or ![alt](target).
MD_LINK = re.compile(r"\]\(([^()\s]+)\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# A document named in capitals (the README, benchmarks/ RESULTS and LOG kind, or an absolute path
# to one), not inside a longer name or a URL. Lower-case bare names are mostly files the scripts write
# (results_thd.md); docs/<page>.md citations are DOC_REF's.
MD_NAME = re.compile(r"(?<![\w./-])(/?(?:[\w.-]+/)*[A-Z][A-Z0-9_-]*\.md)(?![\w-])")
# A Markdown link to a .md file (the anchor aside).
MD_FILE_LINK = re.compile(r"\]\(([^()\s]+?\.md)(?:#[^()\s]*)?\)")
URL = re.compile(r"\b[a-z][a-z0-9+.-]*://\S+")
FENCE = re.compile(r"^\s*(```|~~~)")


def _tracked_files() -> list[str]:
    try:
        out = subprocess.run(
            ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True, timeout=60
        ).stdout
        files = [f for f in out.decode().split("\0") if f]
    except (OSError, subprocess.SubprocessError):
        files = []
    if not files:  # not a git checkout (e.g. an unpacked sdist): every file of the tree
        for base, dirs, names in os.walk(ROOT):
            dirs[:] = [d for d in dirs if not d.startswith(".") and d not in ("build", "dist", "__pycache__")]
            files += [os.path.relpath(os.path.join(base, n), ROOT) for n in names]
    return sorted(files)


def _text(rel: str) -> str | None:
    path = os.path.join(ROOT, rel)
    if not os.path.isfile(path):  # tracked but removed in the work tree
        return None
    with open(path, "rb") as f:
        data = f.read()
    if b"\0" in data[:8192]:
        return None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return None


@lru_cache(maxsize=None)
def _tracked_texts() -> tuple[tuple[str, str], ...]:
    out = []
    for rel in _tracked_files():
        text = _text(rel)
        if text is not None:
            out.append((rel, text))
    return tuple(out)


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: link markup reduced to its text, lower case, everything
    but letters, digits, '_', '-' and spaces dropped, spaces turned into '-'."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = re.sub(r"<[^>]+>", "", text).strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@lru_cache(maxsize=None)
def anchors_of(rel: str) -> frozenset[str]:
    """Every anchor the headings of a Markdown file produce (duplicates get -1, -2, ...)."""
    text = _text(rel) or ""
    seen: dict[str, int] = {}
    anchors = set()
    fenced = False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
            continue
        m = None if fenced else HEADING.match(line)
        if not m:
            continue
        slug = github_slug(m.group(2))
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return frozenset(anchors)


def _line_of(text: str, pos: int) -> int:
    return text.count("\n", 0, pos) + 1


def _check_target(page: str, anchor: str | None) -> str | None:
    """What is wrong with a reference to ``page`` (relative to the root) and ``anchor``, or None."""
    if not os.path.isfile(os.path.join(ROOT, page)):
        return f"{page} does not exist"
    if anchor and page.endswith(".md") and anchor not in anchors_of(page):
        return f"{page} has no heading with the anchor #{anchor}"
    return None


def test_github_slug():
    assert github_slug("FP8 padding") == "fp8-padding"
    assert github_slug("`min_local_rows`") == "min_local_rows"
    assert github_slug("Roll under verl 0.9.1") == "roll-under-verl-091"
    assert github_slug("merge_router_topk and scatter_router_topk") == "merge_router_topk-and-scatter_router_topk"
    assert github_slug("verl's scheduler (DPxCP)") == "verls-scheduler-dpxcp"
    assert github_slug("See [cp.md](cp.md)") == "see-cpmd"


def test_no_file_cites_the_retired_contract():
    hits = [
        f"{rel}:{_line_of(text, m.start())}"
        for rel, text in _tracked_texts()
        for m in re.finditer(re.escape(RETIRED), text)
    ]
    assert not hits, f"cite docs/<page>.md#<anchor> instead of {RETIRED}: " + ", ".join(hits)


def test_docs_references_exist():
    bad = []
    for rel, text in _tracked_texts():
        for m in DOC_REF.finditer(text):
            page, anchor = m.group(1), (m.group(2) or "")[1:] or None
            problem = _check_target(os.path.normpath(page), anchor)
            if problem:
                bad.append(f"{rel}:{_line_of(text, m.start())}: {m.group(0)}: {problem}")
    assert not bad, "\n".join(bad)


def _markdown_files() -> list[str]:
    return [rel for rel, _ in _tracked_texts() if rel == "README.md" or (rel.startswith("docs/") and rel.endswith(".md"))]


def test_docs_exist():
    pages = set(_markdown_files())
    for page in ("README.md", "docs/README.md", "docs/layout.md", "docs/ops.md", "docs/cp.md",
                 "docs/router_replay.md", "docs/mla.md", "docs/decisions.md"):
        assert page in pages, f"{page} is not a tracked file"


def test_markdown_links_resolve():
    bad = []
    texts = dict(_tracked_texts())
    for rel in _markdown_files():
        text = texts[rel]
        fenced_spans, pos, fenced = [], 0, False
        for line in text.splitlines(keepends=True):  # links inside code blocks are not links
            if FENCE.match(line):
                fenced = not fenced
            elif fenced:
                fenced_spans.append((pos, pos + len(line)))
            pos += len(line)
        for m in MD_LINK.finditer(text):
            if any(a <= m.start() < b for a, b in fenced_spans):
                continue
            target = m.group(1)
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:, ...
                continue
            path, _, anchor = target.partition("#")
            page = os.path.normpath(os.path.join(os.path.dirname(rel), path)) if path else rel
            if page.startswith(".."):
                bad.append(f"{rel}:{_line_of(text, m.start())}: {target}: outside the repository")
                continue
            problem = _check_target(page, anchor or None)
            if problem:
                bad.append(f"{rel}:{_line_of(text, m.start())}: {target}: {problem}")
    assert not bad, "\n".join(bad)


def missing_md_citations(rel: str, text: str, files: set) -> list[str]:
    """The Markdown files that ``text`` (the file ``rel``) cites and ``files`` (paths relative to
    the root) does not hold, as "line: name". A Markdown link (``.md`` files only) resolves against
    ``rel``'s folder; a bare name against ``rel``'s folder, the root, or, without a folder of its
    own, any file of that name (RESULTS.md is benchmarks/RESULTS.md wherever it is mentioned). An
    absolute path is never in the repository; URLs are skipped."""
    urls = [m.span() for m in URL.finditer(text)]
    by_name = {os.path.basename(f) for f in files}
    folder = os.path.dirname(rel)
    found = {m.start(1): (m.group(1), True) for m in MD_NAME.finditer(text)}
    if rel.endswith(".md"):  # a link's target is resolved as a link, not as a bare name
        found.update({m.start(1): (m.group(1), False) for m in MD_FILE_LINK.finditer(text)})
    bad = []
    for pos, (name, bare) in sorted(found.items()):
        if any(a <= pos < b for a, b in urls):
            continue
        if name.startswith("/"):
            ok = False
        else:
            here = os.path.normpath(os.path.join(folder, name))
            ok = here in files or (bare and (os.path.normpath(name) in files or ("/" not in name and name in by_name)))
        if not ok:
            bad.append(f"{_line_of(text, pos)}: {name}")
    return bad


def test_missing_md_citations_finds_what_is_missing():
    files = {"README.md", "docs/ops.md", "benchmarks/RESULTS.md", "benchmarks/LOG.md"}
    gone = "PERFORMANCE" + ".md"  # built, so that this file does not cite it
    text = "\n".join([
        f"targets ({gone}); see {gone}#floors",  # 1: bare, twice
        "numbers in RESULTS.md and benchmarks/LOG.md, contract in [ops](docs/ops.md#errors)",  # 2: all exist
        f"[perf](../{gone}) and [gone](docs/{gone.lower()})",  # 3: links out of the tree and to a missing page
        f"https://example.org/{gone} and /work/shared/{gone}",  # 4: a URL (skipped), an absolute path
        "results_thd.md is written by the script",  # 5: lower case, not a document
    ])
    assert missing_md_citations("README.md", text, files) == [
        f"1: {gone}", f"1: {gone}", f"3: ../{gone}", f"3: docs/{gone.lower()}", f"4: /work/shared/{gone}",
    ]
    # A bare name resolves against the citing file's folder too; a link only there.
    assert missing_md_citations("benchmarks/x.py", "see LOG.md", files) == []
    assert missing_md_citations("benchmarks/x.md", "[log](LOG.md) [ops](docs/ops.md)", files) == ["1: docs/ops.md"]


def test_cited_markdown_files_exist():
    texts = _tracked_texts()
    files = {rel for rel, _ in texts} | set(_tracked_files())
    bad = [f"{rel}:{where}" for rel, text in texts for where in missing_md_citations(rel, text, files)]
    assert not bad, "cites a Markdown file the repository does not hold:\n" + "\n".join(bad)


def _section(text: str, title: str) -> str:
    m = re.search(rf"^##\s+{re.escape(title)}\s*$(.*?)(?=^##\s|\Z)", text, flags=re.M | re.S)
    assert m, f"README.md has no '## {title}' section"
    return m.group(1)


def test_readme_quick_start_has_two_commands():
    text = _text("README.md")
    assert text is not None
    section = _section(text, "Quick start")
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section, flags=re.M | re.S)
    assert len(blocks) == 1, f"the Quick start must hold one code block, found {len(blocks)}"
    commands, current = [], ""
    for line in blocks[0].splitlines():
        if current:
            current += " " + line.strip()
        elif line.strip() and not line.strip().startswith("#"):
            current = line.strip()
        if current and not current.endswith("\\"):
            commands.append(current)
            current = ""
    if current:
        commands.append(current)
    assert len(commands) == 2, f"the Quick start must hold exactly two commands, found {len(commands)}: {commands}"


@pytest.mark.parametrize("page", ["docs/layout.md", "docs/cp.md", "docs/mla.md", "docs/router_replay.md"])
def test_cited_anchors_are_stable(page):
    """Anchors the code cites; renaming a heading must update the citations (and this list)."""
    wanted = {
        "docs/layout.md": {"rules", "alignment", "fp8-padding", "min_local_rows", "pad_to_length_bucket",
                           "invariants", "pack", "padding-rows", "roll", "unpack", "autograd"},
        "docs/cp.md": {"cp-layouts", "zigzag", "contiguous", "collectives", "dynamic-cp"},
        "docs/mla.md": {"semantics", "backends", "auto", "causal-alignment"},
        "docs/router_replay.md": {"record", "replay", "fp8-padding"},
    }[page]
    missing = wanted - anchors_of(page)
    assert not missing, f"{page} lost the anchors {sorted(missing)}"
