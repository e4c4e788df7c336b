#!/usr/bin/env python3
"""Every relative link of README.md, docs/*.md and bench/*.md (bench/log/ included) points at a file
of the repository, and every #anchor at a heading of its page (GitHub's slugs).

  check_links.py [ROOT]
"""
import glob
import os
import re
import sys

LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading):
    s = heading.strip().lower()
    s = re.sub(r"[`*_]", "", s)
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(path):
    text = open(path, encoding="utf-8").read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, flags=re.M)}


def main(argv):
    root = argv[0] if argv else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    pages = [os.path.join(root, "README.md")] + glob.glob(os.path.join(root, "docs", "*.md")) \
        + glob.glob(os.path.join(root, "bench", "*.md")) + glob.glob(os.path.join(root, "bench", "log", "*.md"))
    bad = 0
    for page in sorted(pages):
        text = re.sub(r"```.*?```", "", open(page, encoding="utf-8").read(), flags=re.S)
        for target in LINK.findall(text):
            if re.match(r"^[a-z]+:", target):
                continue  # http(s), mailto: not checked here
            path, _, anchor = target.partition("#")
            dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
            rel = os.path.relpath(page, root)
            if not os.path.exists(dest):
                print(f"{rel}: link to {target}: no such file")
                bad += 1
            elif anchor and dest.endswith(".md") and anchor not in anchors(dest):
                print(f"{rel}: link to {target}: no heading '#{anchor}' in {os.path.relpath(dest, root)}")
                bad += 1
    print(f"check_links.py: {len(pages)} pages, {bad} broken links")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
