"""
The README and docs/*.md lead somewhere: every relative link points to a file of the repository (and an anchor to a
heading of the page it names), and every page of docs/ can be reached from the README.

Links are markdown's `[text](path)`, `[text](path#anchor)`, `[text](#anchor)` and images `![text](path)`, outside
code; a path is relative to the page that holds it, as GitHub reads it. http(s) and mailto links are not fetched.
"""

import glob
import os
import re

from helpers import REPO_ROOT

LINK = re.compile(r"!?\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = ("http://", "https://", "mailto:")


def pages():
    """The README and every page of docs/, as paths relative to the repository."""
    docs = sorted(glob.glob(os.path.join(REPO_ROOT, "docs", "*.md")))
    return ["README.md"] + [os.path.relpath(p, REPO_ROOT) for p in docs]


def without_code_blocks(text):
    """`text` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def prose(text):
    """`text` without its fenced code blocks and inline code spans (a link there is code, not a link)."""
    return re.sub(r"`[^`\n]*`", "", without_code_blocks(text))


def links(text):
    """The targets of the markdown links and images in `text`'s prose, as written."""
    return LINK.findall(prose(text))


def anchors(text):
    """
    The anchors GitHub gives the headings of a markdown page: lower case, punctuation dropped, spaces to hyphens, a
    repeated heading's anchor numbered (-1, -2, ...).
    """
    seen, found = {}, set()
    for line in without_code_blocks(text).splitlines():
        heading = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if heading:
            slug = re.sub(r"[^\w\- ]", "", heading.group(1).strip().lower()).replace(" ", "-")
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def broken_links(page, text):
    """[(target, why)] for the relative links of `page` (a path relative to the repository) whose text is `text`."""
    broken = []
    for target in links(text):
        if target.startswith(EXTERNAL):
            continue
        path, _, anchor = target.partition("#")
        file = os.path.normpath(os.path.join(REPO_ROOT, os.path.dirname(page), path or os.path.basename(page)))
        if not file.startswith(REPO_ROOT + os.sep) or not os.path.exists(file):
            broken.append((target, "no such file in the repository"))
        elif anchor and file.endswith(".md"):
            if anchor not in anchors(open(file, encoding="utf-8").read()):
                broken.append((target, f"no heading with the anchor #{anchor}"))
    return broken


def test_every_relative_link_points_to_a_file_of_the_repository():
    broken = {}
    for page in pages():
        found = broken_links(page, open(os.path.join(REPO_ROOT, page), encoding="utf-8").read())
        if found:
            broken[page] = found
    assert not broken, broken


def test_a_broken_link_is_found():
    """The check itself: a missing file, a missing anchor, links in code (ignored), and good ones."""
    text = ("[gone](docs/gone.md), [anchor](docs/hardware.md#no-such-heading), `[code](nowhere.md)`,\n"
            "```\n[block](nowhere.md)\n```\n[good](docs/hardware.md#the-compute-dtype), [web](https://example.com),\n"
            "[code in a heading](docs/export.md#the-model-our-own-modeling-file-layout-remote)")
    assert broken_links("README.md", text) == [("docs/gone.md", "no such file in the repository"),
                                               ("docs/hardware.md#no-such-heading",
                                                "no heading with the anchor #no-such-heading")]
    assert broken_links("docs/serving.md", "[back](../README.md#layout), [page](engine.md), [up](#openais-api)") == []
    assert broken_links("docs/serving.md", "[up](#no-such-heading)") != []
    assert broken_links("docs/serving.md", "[here](docs/engine.md)") != []  # relative to the page, not the root


def test_every_docs_page_is_linked_from_the_readme():
    readme = open(os.path.join(REPO_ROOT, "README.md"), encoding="utf-8").read()
    linked = {os.path.normpath(target.partition("#")[0]) for target in links(readme)}
    unlinked = [page for page in pages()[1:] if page not in linked]
    assert not unlinked, f"docs pages no link of the README leads to: {unlinked}"


def test_every_docs_page_named_in_the_text_exists():
    """A page named in prose or code (`docs/engine.md`, as most cross-references here are written) exists too."""
    missing = {}
    for page in pages():
        text = open(os.path.join(REPO_ROOT, page), encoding="utf-8").read()
        names = sorted({name for name in re.findall(r"\bdocs/[\w./-]+\.md\b", text)
                        if not os.path.exists(os.path.join(REPO_ROOT, name))})
        if names:
            missing[page] = names
    assert not missing, missing
