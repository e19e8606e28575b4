"""
The library's size in code tokens: Python's own tokens of nanochat/*.py at a commit, comments, docstrings and line
structure left out, so that a longer explanation never counts as more code.

    python bench/code_size.py                 # HEAD
    python bench/code_size.py 3cc4c3b HEAD    # several commits, one line each

Counted by Python's tokenize (no download, the same count on any machine). The figures: bench/RESULTS.md.
"""

import io
import subprocess
import sys
import tokenize

SKIPPED = (tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER)
STATEMENT_START = (tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT)


def code_tokens(source):
    """Tokens of `source` that are code: not comments, not line structure, not a string standing as a statement."""
    count = 0
    previous = tokenize.NEWLINE
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in SKIPPED:
            if token.type in STATEMENT_START:
                previous = token.type
            continue
        if not (token.type == tokenize.STRING and previous in STATEMENT_START):  # a docstring is not code
            count += 1
        previous = None
    return count


def library_tokens(commit):
    """{file: code tokens} of nanochat/*.py at `commit`."""
    git = ["git", "-C", sys.path[0] + "/.."]
    names = subprocess.run(git + ["ls-tree", "-r", "--name-only", commit, "nanochat/"], capture_output=True,
                           text=True, check=True).stdout.split()
    return {name: code_tokens(subprocess.run(git + ["show", f"{commit}:{name}"], capture_output=True, text=True,
                                             check=True).stdout)
            for name in names if name.endswith(".py")}


if __name__ == "__main__":
    if any(arg.startswith("-") for arg in sys.argv[1:]):  # --help, or an option this script does not have
        print(__doc__.strip())
        sys.exit(0 if sys.argv[1:] in (["--help"], ["-h"]) else 2)
    for commit in sys.argv[1:] or ["HEAD"]:
        files = library_tokens(commit)
        print(f"{commit}: {sum(files.values()):,} code tokens in {len(files)} files of nanochat/")
