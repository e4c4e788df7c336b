#!/usr/bin/env python3
"""Turns a public header's plain comments into Doxygen doc comments where they document a name:

  doc_comments.py HEADER...      rewrites the files in place (comments only: code is untouched)

- the file's leading comment block becomes `/// \\file` + the block;
- a block of `//` lines directly above a declaration at namespace or class scope becomes `///`;
- a trailing `// text` after a declaration (member, enumerator, function) becomes `///< text`,
  and comment-only lines continuing it become `///<` too;
- comments inside function bodies, before blank lines, `}` or preprocessor lines, and blocks that
  open a `Note [...]`, stay as they are.
Running it twice changes nothing.
"""
import re
import sys

SCOPE_OPEN = re.compile(r"^\s*(?:template\s*<.*>\s*)?(?:namespace\b|(?:class|struct|union|enum(?:\s+class)?)\b[^;()]*\{)")
NOT_DECL = re.compile(r"^\s*(?:#|}|namespace\b|public:|private:|protected:|//|$)")


def code_part(line):
    """(code, comment column or -1): the first // outside string and char literals."""
    q = None
    i = 0
    while i < len(line):
        c = line[i]
        if q:
            if c == "\\":
                i += 2
                continue
            if c == q:
                q = None
        elif c in "\"'":
            if c == "'" and i > 0 and line[i - 1].isalnum():  # digit separators
                i += 1
                continue
            q = c
        elif line.startswith("//", i):
            return line[:i], i
        i += 1
    return line, -1


def convert(text):
    lines = text.split("\n")
    out = list(lines)
    # 1. leading block -> \file
    k = 0
    while k < len(lines) and lines[k].startswith("//"):
        k += 1
    if k and not lines[0].startswith("///"):
        for j in range(k):
            out[j] = "///" + lines[j][2:]
        out[0] = "/// \\file\n" + out[0]
    # 2. scan with a stack of scope kinds
    stack = []  # True: namespace/class scope, False: a body
    trailing_col = -1
    j = k
    while j < len(lines):
        line = lines[j]
        stripped = line.strip()
        at_scope = all(stack)
        if stripped.startswith("//") and not stripped.startswith("///"):
            # continuation of a trailing doc comment?
            col = line.index("//")
            if trailing_col >= 0 and abs(col - trailing_col) <= 1 and at_scope:
                out[j] = line[:col] + "///<" + line[col + 2:]
                j += 1
                continue
            # a block: find its end
            e = j
            while e < len(lines) and lines[e].strip().startswith("//") and not lines[e].strip().startswith("///"):
                e += 1
            nxt = lines[e] if e < len(lines) else ""
            if at_scope and not NOT_DECL.match(nxt) and not re.match(r"^\s*//\s*Note \[", lines[j]):
                for x in range(j, e):
                    c = lines[x].index("//")
                    out[x] = lines[x][:c] + "///" + lines[x][c + 2:]
            trailing_col = -1
            j = e
            continue
        code, col = code_part(line)
        trailing_col = -1
        if col >= 0 and at_scope and code.strip() and not line[col:].startswith("///"):
            c = code.strip()
            if not c.startswith(("}", "#", "public:", "private:", "protected:", "namespace")) \
                    and (c.endswith((";", ",", "{", "{}", ")")) or c.endswith("= 0;")):
                out[j] = line[:col] + "///<" + line[col + 2:]
                trailing_col = col
        # braces
        opens = code.count("{")
        closes = code.count("}")
        is_scope = bool(SCOPE_OPEN.match(code))
        net = opens - closes
        if net > 0:
            stack.append(is_scope)
            for _ in range(net - 1):
                stack.append(False)
        elif net < 0:
            for _ in range(-net):
                if stack:
                    stack.pop()
        j += 1
    return "\n".join(out)


def main(paths):
    for p in paths:
        text = open(p, encoding="utf-8").read()
        new = convert(text)
        if new != text:
            open(p, "w", encoding="utf-8").write(new)
            print(f"doc_comments.py: {p}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
