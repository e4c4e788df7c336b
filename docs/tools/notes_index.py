#!/usr/bin/env python3
"""The Notes index of docs/design.md: every `Note [...]` in the code and the file that defines it.

  notes_index.py [ROOT]           prints the index as a Markdown table
  notes_index.py --check [ROOT]   fails, naming them, when a note of the code is missing from
                                  docs/design.md or design.md lists a note the code no longer has

A note is defined where a comment line starts with it (`// Note [Bucket pool bound]`, c10d's
convention) or where it is followed by a colon (`Note [Gloo AVG]: ...`); other mentions cite it. A note only cited anywhere is listed with its first citer.
"""
import os
import re
import sys

DIRS = ["include", "src", "examples", "tests", "bench", "python_bindings", "scripts", "cmake", ".ci"]
TOP_FILES = ["CMakeLists.txt"]
EXTS = (".hpp", ".cpp", ".h", ".cu", ".cuh", ".py", ".sh", ".cmake", ".txt", ".in", "")
NOTE = re.compile(r"Note \[([^\]\n]+)\]")
DEFINITION = re.compile(r"^\s*(?://+|#+|\*)\s*Note \[([^\]\n]+)\]|Note \[([^\]\n]+)\]:")


def source_files(root):
    for top in TOP_FILES:
        if os.path.isfile(os.path.join(root, top)):
            yield top
    for d in DIRS:
        for base, dirs, files in os.walk(os.path.join(root, d)):
            dirs[:] = sorted(x for x in dirs if x not in ("corpus", "assets", "results", "__pycache__"))
            for f in sorted(files):
                path = os.path.join(base, f)
                if f.endswith(".md") or not f.endswith(EXTS) or os.path.getsize(path) > 2_000_000:
                    continue
                if f.endswith("") and "." not in f and not os.access(path, os.X_OK):
                    continue
                yield os.path.relpath(path, root)


def scan(root):
    """name -> (defining file or None, first citing file)"""
    defined, cited = {}, {}
    for rel in source_files(root):
        try:
            text = open(os.path.join(root, rel), encoding="utf-8").read()
        except (UnicodeDecodeError, OSError):
            continue
        for line in text.splitlines():
            for m in DEFINITION.finditer(line):
                if m.start() == 0 or m.group(2):
                    defined.setdefault(m.group(1) or m.group(2), rel)
            for name in NOTE.findall(line):
                cited.setdefault(name, rel)
    return {n: (defined.get(n), cited[n]) for n in cited}


def table(notes):
    rows = ["| note | defined in |", "|---|---|"]
    for name in sorted(notes, key=str.lower):
        where, citer = notes[name]
        rows.append(f"| Note [{name}] | `{where}` |" if where else
                    f"| Note [{name}] | cited in `{citer}` (no defining block) |")
    return "\n".join(rows)


def main(argv):
    check = "--check" in argv
    args = [a for a in argv if a != "--check"]
    root = args[0] if args else os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    notes = scan(root)
    if not check:
        print(table(notes))
        return 0
    design = open(os.path.join(root, "docs", "design.md"), encoding="utf-8").read()
    index = design[design.find("## Notes index"):]
    listed = set(NOTE.findall(index))
    missing = sorted(set(notes) - listed)
    stale = sorted(listed - set(notes))
    for n in missing:
        print(f"docs/design.md: Note [{n}] ({notes[n][0] or notes[n][1]}) is not in the Notes index")
    for n in stale:
        print(f"docs/design.md: the Notes index lists Note [{n}], which no code mentions any more")
    if missing or stale:
        print("regenerate the table with: python3 docs/tools/notes_index.py")
        return 1
    print(f"docs/design.md lists all {len(notes)} notes of the code")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
