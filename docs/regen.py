"""What a page prints, a command printed: regenerate or check the marked outputs and figures of README.md, docs/ and
configs/.

    uv run python docs/regen.py            # exit 1 and a diff per stale page; 0 when every page is current
    uv run python docs/regen.py --write    # rewrite every marked block and figure from its command
    uv run python docs/regen.py --write docs/estimate.md configs/qwen3.6-27b-8gpu.toml   # only these pages

Each marker names a command; it runs from the repository root (`uv run NAME ARGS` runs this environment's console
script NAME), once per page set however many markers name it. Only CPU commands that take seconds belong here
(`dflash-estimate`, `dflash-data stats --config`): figures measured on GPUs stay with their command and date in
docs/results.md and are not regenerated.

Markdown, a block: the fenced block right after the marker holds `$ COMMAND` and what it printed.

    <!-- output: uv run dflash-estimate --config C --gpu-memory 95GiB | from: layouts on | from: pace at | exit: 1 -->

`from: TEXT` keeps the output from the first line that starts with TEXT (leading spaces ignored) to the end of its
paragraph (the next blank line); several are kept in order, with a `...` line where lines are left out. Without
`from:` the whole output. `head: N` keeps at most N lines of each part. `exit: N` is the exit code the command must
give (default 0: a command that fails is an error, never a sample).

Markdown, a recorded sample (output of a command that ran on another machine, a GPU box, and was kept in the
repository): checked, never rewritten. Every line of the fenced block after the marker but `...` must be a line of
the file, in the file's order.

    <!-- recorded: tests/data/preflight_h200_run.txt -->

Markdown, a figure in prose or a table cell (HTML comments, so the page shows only the value):

    <!-- cmd e8: uv run dflash-estimate --config configs/qwen3.6-27b-8gpu.toml --gpu-memory 95GiB -->
    ... fits at <!-- fig e8: FSDP2: colocated {} GiB -->91.39<!-- /fig --> GiB ...

`cmd NAME: COMMAND` names a command once per page, anywhere in it. Between `fig` and `/fig` stands what the command
printed at `{}` (a number or a word): the text around `{}` must match the output, a run of spaces matching any run of
spaces and `...` any text, across lines too; the first match counts. Never inside `code` (the page would show the
marker there): write `recompute auto` -> <!-- fig ... -->mlp<!-- /fig -->.

TOML (configs/), a block of comment lines:

    # output: uv run dflash-estimate --config configs/qwen3.6-27b-8gpu.toml --gpu-memory 95GiB | from: layouts on
    # layouts on GPUs of 95.00 GiB (docs/training.md#layouts):
    # ...
    # end output

tests/test_docs_outputs.py runs the check, so a change to the model or a default that moves a printed figure fails
the suite until this is run with --write and the diff is read.
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import shlex
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PAGES = ("README.md", "docs/*.md", "configs/*.toml")

MD_BLOCK = re.compile(r"(?P<marker><!-- output: (?P<spec>.*?) -->)\n(?P<open>```[^\n]*)\n(?P<body>.*?)(?P<close>^```)",
                      re.S | re.M)
MD_RECORDED = re.compile(r"<!-- recorded: (?P<file>\S+) -->\n```[^\n]*\n(?P<body>.*?)^```", re.S | re.M)
MD_CMD = re.compile(r"<!-- cmd (?P<name>[\w.-]+): (?P<command>.*?) -->")
MD_FIG = re.compile(r"(?P<open><!-- fig (?P<name>[\w.-]+): (?P<pattern>.*?) -->)(?P<value>.*?)(?P<close><!-- /fig -->)")
TOML_BLOCK = re.compile(r"^# output: (?P<spec>.*)\n(?P<body>(?:#.*\n)*?)# end output$", re.M)
VALUE = r"(-?\d[\d,]*(?:\.\d+)?|[A-Za-z_][\w-]*)"


class DocError(ValueError):
    """A marker that cannot be regenerated: a command that failed, a `from:` or a figure the output does not hold."""


@dataclass(frozen=True)
class Output:
    command: str
    code: int
    text: str


@dataclass(frozen=True)
class Spec:
    command: str
    starts: tuple[str, ...] = ()  # `from:` texts, in order
    code: int = 0  # the exit code the command must give
    head: int | None = None  # at most this many lines of each part


def parse_spec(spec: str) -> Spec:
    """`COMMAND | from: A | from: B | head: N | exit: N` -> Spec."""
    command, *options = [s.strip() for s in spec.split(" | ")]
    starts, code, head = [], 0, None
    for opt in options:
        key, _, value = (t.strip() for t in opt.partition(":"))
        if key == "from" and value:
            starts.append(value)
        elif key in ("exit", "head") and value.isdigit():
            code, head = (int(value), head) if key == "exit" else (code, int(value))
        else:
            raise DocError(f"{spec!r}: unknown option {opt!r} (from: TEXT, head: N, exit: N)")
    return Spec(command, tuple(starts), code, head)


class Runner:
    """Runs each command once from `root` and keeps its output."""

    def __init__(self, root: Path = ROOT):
        self.root = root
        self.seen: dict[str, Output] = {}

    def argv(self, command: str) -> list[str]:
        words = shlex.split(command)
        if words[:2] != ["uv", "run"] or len(words) < 3:
            raise DocError(f"{command!r}: a marked command starts with `uv run` and a console script")
        script = Path(sys.executable).parent / words[2]
        found = str(script) if script.is_file() else shutil.which(words[2])
        if found is None:
            raise DocError(f"{command!r}: no console script {words[2]} in this environment")
        return [found, *words[3:]]

    def prefetch(self, commands: set[str], workers: int = 4) -> None:
        """Run the commands not yet seen side by side (each mostly waits on its imports)."""
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(self, sorted(commands - self.seen.keys())))

    def __call__(self, command: str) -> Output:
        if command not in self.seen:
            env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "200"}
            done = subprocess.run(self.argv(command), cwd=self.root, env=env, capture_output=True, text=True, timeout=300)
            if done.returncode not in (0, 1):
                raise DocError(f"{command!r} exited {done.returncode}: {done.stderr.strip()[-500:]}")
            self.seen[command] = Output(command, done.returncode, done.stdout.rstrip("\n"))
        return self.seen[command]


def excerpt(out: Output, spec: Spec) -> list[str]:
    """The lines a block shows: all of them, or from each `from:` line to the end of its paragraph, each part cut to
    `head:` lines; `...` where lines are left out."""
    lines = out.text.split("\n")
    kept: list[str] = []
    at = 0
    for start in spec.starts or [None]:
        first = 0 if start is None else next(
            (i for i in range(at, len(lines)) if lines[i].lstrip().startswith(start)), None)
        if first is None:
            raise DocError(f"{out.command!r}: no line after line {at + 1} of its output starts with {start!r}")
        last = len(lines) if start is None else next(
            (i for i in range(first, len(lines)) if not lines[i].strip()), len(lines))
        if spec.head is not None:
            last = min(last, first + spec.head)
        skipped = lines[at:first]
        kept += ["..."] if any(line.strip() for line in skipped) else skipped
        kept += lines[first:last]
        at = last
    if any(line.strip() for line in lines[at:]):
        kept.append("...")
    return kept


def block(out: Output, spec: Spec) -> list[str]:
    if out.code != spec.code:
        raise DocError(f"{out.command!r} exited {out.code}, the marker expects {spec.code} (`| exit: {out.code}` if meant)")
    return excerpt(out, spec)


def figure(out: Output, pattern: str) -> str:
    """What `out` printed at the `{}` of `pattern` (spaces match any run of spaces, `...` any text)."""
    if pattern.count("{}") != 1:
        raise DocError(f"figure {pattern!r}: give exactly one {{}}")

    def literal(text: str) -> str:
        return ".*?".join(r"[ \t]+".join(re.escape(w) for w in re.split(r"\s+", part)) for part in text.split("..."))

    before, after = pattern.split("{}")
    found = re.search(literal(before) + VALUE + literal(after), out.text, re.S)
    if found is None:
        raise DocError(f"{out.command!r}: its output holds nothing like {pattern!r}")
    return found.group(1)


def check_recorded(text: str, root: Path) -> None:
    """Every recorded sample's lines are lines of its file, in order (`...` stands for lines left out)."""
    for m in MD_RECORDED.finditer(text):
        path = root / m["file"]
        if not path.is_file():
            raise DocError(f"recorded sample of {m['file']}: no such file")
        source = iter(path.read_text(encoding="utf-8").split("\n"))
        for line in m["body"].rstrip("\n").split("\n"):
            if line != "..." and not any(line == have for have in source):
                raise DocError(f"recorded sample of {m['file']}: {line!r} is not a line of it (or not in its order)")


def regen_markdown(text: str, run: Runner) -> str:
    check_recorded(text, run.root)
    commands = {m["name"]: m["command"] for m in MD_CMD.finditer(text)}

    def one_block(m: re.Match) -> str:
        spec = parse_spec(m["spec"])
        body = [f"$ {spec.command}", *block(run(spec.command), spec)]
        return f"{m['marker']}\n{m['open']}\n" + "\n".join(body) + "\n" + m["close"]

    def one_figure(m: re.Match) -> str:
        before = m.string[m.string.rfind("\n", 0, m.start()) + 1:m.start()]
        if before.count("`") % 2:
            raise DocError(f"figure {m['pattern']!r} stands inside `code`, where the page would show its marker")
        if m["name"] not in commands:
            raise DocError(f"figure {m['pattern']!r}: no `<!-- cmd {m['name']}: ... -->` on this page")
        return m["open"] + figure(run(commands[m["name"]]), m["pattern"]) + m["close"]

    return MD_FIG.sub(one_figure, MD_BLOCK.sub(one_block, text))


def regen_toml(text: str, run: Runner) -> str:
    def one_block(m: re.Match) -> str:
        spec = parse_spec(m["spec"])
        body = "".join(f"# {line}".rstrip() + "\n" for line in block(run(spec.command), spec))
        return f"# output: {m['spec']}\n{body}# end output"

    return TOML_BLOCK.sub(one_block, text)


def regen(path: Path, run: Runner, text: str | None = None) -> str:
    """The page at `path` as its commands print it today (`text`: its content, else read from the file)."""
    text = path.read_text(encoding="utf-8") if text is None else text
    try:
        return regen_toml(text, run) if path.suffix == ".toml" else regen_markdown(text, run)
    except DocError as e:
        raise DocError(f"{path}: {e}") from None


def commands_of(path: Path, text: str) -> set[str]:
    """Every command the page's markers name."""
    if path.suffix == ".toml":
        return {parse_spec(m["spec"]).command for m in TOML_BLOCK.finditer(text)}
    return {parse_spec(m["spec"]).command for m in MD_BLOCK.finditer(text)} | {m["command"] for m in MD_CMD.finditer(text)}


def pages(root: Path = ROOT) -> list[Path]:
    return [p for pattern in PAGES for p in sorted(root.glob(pattern))]


def shown(path: Path, root: Path = ROOT) -> Path:
    return path.relative_to(root) if path.is_relative_to(root) else path


def drift(paths: list[Path], run: Runner) -> dict[Path, str]:
    """Page -> unified diff of what its commands print today against what it shows; pages that match are left out."""
    stale = {}
    texts = {path: path.read_text(encoding="utf-8") for path in paths}
    run.prefetch(set().union(*(commands_of(path, text) for path, text in texts.items())))
    for path, old in texts.items():
        new = regen(path, run, old)
        if new != old:
            name = shown(path, run.root)
            stale[path] = "".join(difflib.unified_diff(old.splitlines(keepends=True), new.splitlines(keepends=True),
                                                       f"{name} (on the page)", f"{name} (printed now)"))
    return stale


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="docs/regen.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale pages instead of printing their diff")
    parser.add_argument("pages", nargs="*", type=Path, help="pages to check (default: README.md, docs/*.md, configs/*.toml)")
    args = parser.parse_args(argv)
    run = Runner(ROOT)
    chosen = [p.resolve() for p in args.pages] or pages(ROOT)
    try:
        stale = drift(chosen, run)
    except DocError as e:
        print(f"docs/regen.py: error: {e}", file=sys.stderr)
        return 2
    for path, diff in stale.items():
        if args.write:
            path.write_text(regen(path, run), encoding="utf-8")
            print(f"rewrote {shown(path)}")
        else:
            sys.stdout.write(diff)
    if stale and not args.write:
        print(f"{len(stale)} page(s) differ from what their commands print: uv run python docs/regen.py --write",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
