#!/usr/bin/env python3
"""Regenerates the README's command excerpts from the commands themselves.

An excerpt is a fenced block right after a marker line

    <!-- generated: COMMAND -->
    ```
    $ COMMAND
    ...its output...
    ```

COMMAND runs with sh from the top of the tree (build/pdmoe must be built); the block becomes
"$ COMMAND" and its standard output. Markdown that a command writes (a table) goes between

    <!-- generated-markdown: COMMAND -->
    ...its output, as the page's own text...
    <!-- end of generated markdown -->
 `tools/readme.py` rewrites README.md in place;
`tools/readme.py --check` changes nothing and exits 1 naming every excerpt that differs (CI runs
it, so a pasted excerpt cannot go stale).
"""
import os
import re
import subprocess
import sys

MARK = re.compile(r"^<!-- generated: (.*) -->$")
MARK_MD = re.compile(r"^<!-- generated-markdown: (.*) -->$")
END_MD = "<!-- end of generated markdown -->"


def output_of(cmd, at):
    run = subprocess.run(["sh", "-c", cmd], capture_output=True, text=True)
    if run.returncode != 0:
        sys.exit(f"README.md:{at}: `{cmd}` exited {run.returncode}: {run.stderr.strip()}")
    return [l + "\n" for l in run.stdout.rstrip("\n").split("\n")]


def regenerate(lines):
    out, stale, i = [], [], 0
    while i < len(lines):
        line = lines[i]
        out.append(line)
        m = MARK.match(line.rstrip("\n"))
        md = MARK_MD.match(line.rstrip("\n"))
        i += 1
        if md:
            cmd = md.group(1)
            end = i
            while end < len(lines) and lines[end].rstrip("\n") != END_MD:
                end += 1
            if end == len(lines):
                sys.exit(f"README.md:{i}: the markdown after `{cmd}` has no \"{END_MD}\" line")
            block = output_of(cmd, i)
            if block != lines[i:end]:
                stale.append(cmd)
            out.extend(block)
            out.append(lines[end])
            i = end + 1
            continue
        if not m:
            continue
        cmd = m.group(1)
        if i >= len(lines) or lines[i].rstrip("\n") != "```":
            sys.exit(f"README.md:{i}: the marker for `{cmd}` is not followed by a ``` block")
        end = i + 1
        while end < len(lines) and lines[end].rstrip("\n") != "```":
            end += 1
        if end == len(lines):
            sys.exit(f"README.md:{i + 1}: the block after `{cmd}` never closes")
        block = ["```\n", f"$ {cmd}\n"] + output_of(cmd, i) + ["```\n"]
        if block != lines[i:end + 1]:
            stale.append(cmd)
        out.extend(block)
        i = end + 1
    return out, stale


def main():
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    os.chdir(root)
    with open("README.md") as f:
        lines = f.readlines()
    out, stale = regenerate(lines)
    if "--check" in sys.argv[1:]:
        for cmd in stale:
            print(f"README.md: the excerpt of `{cmd}` differs from what the command prints now "
                  f"(run tools/readme.py)", file=sys.stderr)
        sys.exit(1 if stale else 0)
    with open("README.md", "w") as f:
        f.writelines(out)
    print(f"README.md: {len(stale)} excerpt(s) regenerated", file=sys.stderr)


if __name__ == "__main__":
    main()
