#!/usr/bin/env python3
"""Check the relative links of the documentation: every link and image in README.md and
docs/*.md (or in the Markdown files given as arguments) whose target is a path must name a file
or directory that exists, and every `#anchor` must name a heading of the target Markdown file (or
of the same file, for `#anchor` alone), using GitHub's heading slugs.

    python3 .ci/doclinks.py                 # README.md and docs/*.md
    python3 .ci/doclinks.py FILE.md ...     # these files instead

Prints one line per broken link (`file:line: target: why`) and exits 1 if there is any, else
prints a summary and exits 0. Links with a scheme (https:, mailto:, ...) are not fetched; links
inside code blocks and code spans are not links. There is no allow-list: a link to a page that is
not written yet is reported as broken.
"""
import glob
import os
import re
import sys
import unicodedata
import urllib.parse

ROOT = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
ATX = re.compile(r"^ {0,3}(#{1,6})(?:[ \t]+(.*?))?(?:[ \t]+#+)?[ \t]*$")
SETEXT = re.compile(r"^ {0,3}(=+|-+)[ \t]*$")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
# [text](target "title") and ![alt](target); the text may hold one level of brackets.
INLINE = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*(<[^>]*>|[^\s)]+)(?:\s+(?:\"[^\"]*\"|'[^']*'|\([^)]*\)))?\s*\)")
REFDEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*(<[^>]*>|\S+)")
HTML_ID = re.compile(r"<a\s+(?:name|id)=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")


def lines_outside_code(text, blank_spans=True):
    """(line number, line) of every line outside fenced code blocks; code spans blanked unless
    `blank_spans` is false."""
    fence = None
    for n, line in enumerate(text.split("\n"), 1):
        m = FENCE.match(line)
        if fence:
            if m and m.group(1)[0] == fence[0] and len(m.group(1)) >= len(fence) and not line.strip()[len(m.group(1)):].strip():
                fence = None
            continue
        if m:
            fence = m.group(1)
            continue
        yield n, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line) if blank_spans else line


def plain(heading):
    """A heading's text as GitHub renders it: code spans keep their content, links their text,
    emphasis markers and HTML tags go."""
    h = re.sub(r"(`+)(.+?)\1", lambda m: m.group(2), heading)
    h = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", h)
    h = re.sub(r"<[^>]+>", "", h)
    h = h.replace("*", "")
    # `_emphasis_` (underscores at word boundaries); `snake_case` keeps its underscores.
    h = re.sub(r"(?<!\w)_+(\S(?:.*?\S)?)_+(?!\w)", r"\1", h)
    return h.strip()


def slug(text):
    """GitHub's anchor for a heading: lower case, every character that is not a letter, a mark,
    a digit, a connector (`_`), a space or a hyphen removed, spaces made hyphens."""
    out = []
    for ch in text.strip().lower():
        cat = unicodedata.category(ch)
        if ch in " -" or cat[0] in "LMN" or cat == "Pc":
            out.append("-" if ch == " " else ch)
    return "".join(out)


_anchors = {}


def anchors(path):
    """The anchors a Markdown file defines: its headings' slugs (repeats numbered -1, -2, ... as
    GitHub does) and the names of explicit `<a name=...>`/`<a id=...>` tags."""
    if path in _anchors:
        return _anchors[path]
    found, seen = set(), {}
    try:
        text = open(path, encoding="utf-8").read()
    except OSError:
        _anchors[path] = found
        return found
    prev = None
    for _, line in lines_outside_code(text, blank_spans=False):
        found.update(HTML_ID.findall(line))
        title = None
        m = ATX.match(line)
        if m:
            title = m.group(2) or ""
        elif prev is not None and prev.strip() and SETEXT.match(line) and not ATX.match(prev):
            title = prev.strip()
        if title is not None:
            s = slug(plain(title))
            k = seen.get(s, 0)
            seen[s] = k + 1
            found.add(s if k == 0 else f"{s}-{k}")
            prev = None
        else:
            prev = line
    _anchors[path] = found
    return found


def links(path):
    """(line, target) of every inline link, image and reference definition outside code."""
    text = open(path, encoding="utf-8").read()
    for n, line in lines_outside_code(text):
        for m in INLINE.finditer(line):
            yield n, m.group(1)
        m = REFDEF.match(line)
        if m:
            yield n, m.group(1)


def check(path):
    problems = []
    base = os.path.dirname(path)
    for n, target in links(path):
        t = target[1:-1] if target.startswith("<") and target.endswith(">") else target
        if not t or SCHEME.match(t) or t.startswith("//"):
            continue
        file_part, _, anchor = t.partition("#")
        file_part = urllib.parse.unquote(file_part)
        dest = os.path.normpath(os.path.join(base, file_part)) if file_part else path
        where = f"{os.path.relpath(path, ROOT)}:{n}: {target}"
        if file_part.startswith("/"):
            problems.append(f"{where}: absolute path (links must be relative to the file)")
            continue
        if not os.path.exists(dest):
            problems.append(f"{where}: {os.path.relpath(dest, ROOT)} does not exist")
            continue
        if anchor and dest.endswith(".md"):
            if os.path.isdir(dest):
                problems.append(f"{where}: #{anchor} on a directory")
            elif urllib.parse.unquote(anchor) not in anchors(dest):
                problems.append(f"{where}: {os.path.relpath(dest, ROOT)} has no heading with anchor #{anchor}")
    return problems


def main(argv):
    files = argv[1:] or [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    files = [os.path.abspath(f) for f in files]
    problems, count = [], 0
    for f in files:
        if not os.path.isfile(f):
            problems.append(f"{f}: no such file")
            continue
        count += sum(1 for _ in links(f))
        problems += check(f)
    for p in problems:
        print(p)
    if problems:
        print(f"doclinks: {len(problems)} broken link(s) in {len(files)} file(s)")
        return 1
    print(f"doclinks: {count} link(s) in {len(files)} file(s), none broken")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
