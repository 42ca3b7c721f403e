"""What a page prints, a command printed: README.md, docs/ and configs/ against the commands their markers name
(docs/regen.py), and the README's walk-through for the users' box run as written.

A failure here means a page is stale: read the diff, then `uv run python docs/regen.py --write` and commit the pages.
"""

from __future__ import annotations

import importlib.util
import json
import re
import shlex
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dflash.data.shards import write_shard

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("docs_regen", ROOT / "docs" / "regen.py")
regen = sys.modules["docs_regen"] = importlib.util.module_from_spec(_spec)  # a script, not a package: loaded by path
_spec.loader.exec_module(regen)


@pytest.fixture(scope="module")
def run():
    return regen.Runner(ROOT)  # one per module: each command runs once for every test here


def test_every_page_shows_what_its_commands_print(run):
    pages = regen.pages(ROOT)
    marked = [p for p in pages if regen.commands_of(p, p.read_text(encoding="utf-8"))]
    # the pages issue #52 found stale carry markers; a page that loses all of them is no longer checked
    assert {"README.md", "docs/estimate.md", "docs/training.md", "configs/qwen3.6-27b-8gpu.toml",
            "configs/qwen3.6-27b-5t3d.toml"} <= {str(p.relative_to(ROOT)) for p in marked}
    stale = regen.drift(pages, run)
    assert not stale, ("pages differ from what their commands print (uv run python docs/regen.py --write):\n"
                       + "".join(stale.values()))


def _copy(tmp_path: Path, page: str, old: str, new: str) -> Path:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert text.count(old) >= 1, f"{page} no longer holds {old!r}; pick another line to change"
    out = tmp_path / Path(page).name
    out.write_text(text.replace(old, new, 1), encoding="utf-8")
    return out


@pytest.mark.parametrize("page, old, new", [
    # a figure of an output block
    ("docs/estimate.md", "FSDP2: colocated 91.39 GiB (recompute off)", "FSDP2: colocated 83.24 GiB (recompute mlp)"),
    # a figure in prose (between fig markers)
    ("docs/estimate.md", "-->71.96<!-- /fig -->", "-->72.0<!-- /fig -->"),
    # a resolved value in a preset's comment block
    ("configs/qwen3.6-27b-8gpu.toml", "78,989 tok/s (recompute off, link", "79,000 tok/s (recompute off, link"),
    # a line left out of a block
    ("README.md", "  fits         split: 1 target + 1 drafter GPUs", "  fits         split: 5 target + 3 drafter GPUs"),
])
def test_a_changed_figure_is_caught_and_rewritten(run, tmp_path, page, old, new):
    changed = _copy(tmp_path, page, old, new)
    stale = regen.drift([changed], run)
    assert changed in stale
    diff = stale[changed].splitlines()
    assert any(line.startswith("-") and new in line for line in diff), stale[changed]  # what the page showed
    assert any(line.startswith("+") and old in line for line in diff), stale[changed]  # what the command prints
    assert regen.regen(changed, run) == (ROOT / page).read_text(encoding="utf-8")  # --write puts the printed text back


def test_a_marker_the_output_does_not_hold_is_an_error(run, tmp_path):
    cmd = "uv run dflash-estimate --config configs/qwen3.6-27b-8gpu.toml --gpu-memory 95GiB"
    page = tmp_path / "a-page"
    page.write_text(f"<!-- cmd e: {cmd} -->\n<!-- fig e: DDP: colocated {{}} GiB -->1<!-- /fig -->\n")
    with pytest.raises(regen.DocError, match="holds nothing like"):
        regen.regen(page, run)
    page.write_text(f"<!-- cmd e: {cmd} -->\n`recompute auto -> <!-- fig e: recompute auto -> {{}} -->mlp<!-- /fig -->`\n")
    with pytest.raises(regen.DocError, match="inside `code`"):
        regen.regen(page, run)
    page.write_text(f"<!-- output: {cmd} | from: no such line -->\n```\n```\n")
    with pytest.raises(regen.DocError, match="starts with 'no such line'"):
        regen.regen(page, run)
    page.write_text(f"<!-- output: {cmd} | exit: 1 -->\n```\n```\n")  # it fits: exit 0, not the 1 the page expects
    with pytest.raises(regen.DocError, match="exited 0, the marker expects 1"):
        regen.regen(page, run)


def test_a_recorded_sample_must_be_lines_of_its_recording(run, tmp_path):
    assert "<!-- recorded: tests/data/preflight_h200_run.txt -->" in (ROOT / "docs/preflight.md").read_text()
    edited = _copy(tmp_path, "docs/preflight.md", "need 24.9 GiB / free 139.8 GiB", "need 23.9 GiB / free 139.8 GiB")
    with pytest.raises(regen.DocError, match="is not a line of it"):
        regen.drift([edited], run)
    reordered = tmp_path / "a-page"  # the verdict before a check: each line is in the file, not in its order
    reordered.write_text("<!-- recorded: tests/data/preflight_h200_run.txt -->\n```\n"
                         "preflight train-cu128: FAILED: 3 check(s) failed: torch-build, env-drift, cuda-libs (2 warnings)\n"
                         "PASS   gpu-processes   no other process holds memory on the 1 assigned GPU(s)\n```\n")
    with pytest.raises(regen.DocError, match="not in its order"):
        regen.regen(reordered, run)


def test_head_and_from_cut_the_output_where_the_page_says():
    out = regen.Output("c", 0, "a\nb\nc\n\nd one\ne\nf\n\ng")
    assert regen.excerpt(out, regen.parse_spec("c | head: 2")) == ["a", "b", "..."]
    assert regen.excerpt(out, regen.parse_spec("c | from: d | head: 2")) == ["...", "d one", "e", "..."]
    assert regen.excerpt(out, regen.parse_spec("c | from: a | from: g")) == ["a", "b", "c", "...", "g"]
    assert regen.excerpt(out, regen.parse_spec("c | from: a | from: d")) == ["a", "b", "c", "", "d one", "e", "f", "..."]
    with pytest.raises(regen.DocError, match="unknown option"):
        regen.parse_spec("c | form: a")


def test_the_command_line_check_exits_1_with_a_diff_and_0_when_current(tmp_path):
    page = _copy(tmp_path, "configs/qwen3.6-27b-5t3d.toml", "drafter 71.96 GiB (recompute off)",
                 "drafter 71.96 GiB (recompute layer)")
    stale = subprocess.run([sys.executable, str(ROOT / "docs" / "regen.py"), str(page)], capture_output=True, text=True)
    assert stale.returncode == 1, stale.stderr
    assert "+#   fits         split: 5 target + 3 drafter GPUs" in stale.stdout and "docs/regen.py --write" in stale.stderr
    fixed = subprocess.run([sys.executable, str(ROOT / "docs" / "regen.py"), "--write", str(page)], capture_output=True,
                           text=True)
    assert fixed.returncode == 0, fixed.stderr
    assert page.read_text() == (ROOT / "configs/qwen3.6-27b-5t3d.toml").read_text()


def _walk_through() -> list[str]:
    """The README's walk-through block, as lines."""
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    found = re.search(r"<!-- walk-through:.*?-->\n```bash\n(.*?)\n```", text, re.S)
    assert found, "README.md lost its walk-through block (<!-- walk-through: ... --> then ```bash)"
    return found.group(1).split("\n")


def _script(words: list[str]) -> list[str]:
    assert words[:2] == ["uv", "run"], words
    return [str(Path(sys.executable).parent / words[2]), *words[3:]]


def _set(config: str, section: str, assignment: str) -> str:
    """`config` with `assignment` (`key = value`) in `[section]`: replacing the key there, else added to the section,
    else in a new section at the end."""
    key = assignment.split(" = ", 1)[0]
    head = re.search(rf"(?m)^\[{section}\][^\n]*\n", config)
    if head is None:
        return config.rstrip("\n") + f"\n\n[{section}]\n{assignment}\n"
    end = re.compile(r"(?m)^\[").search(config, head.end())
    body = config[head.end():end.start() if end else len(config)]
    new = re.sub(rf"(?m)^{key} = .*$", lambda _: assignment, body, count=1)
    if new == body:
        new = f"{assignment}\n{body}"
    return config[:head.end()] + new + config[head.end() + len(body):]


def test_set_puts_a_key_in_its_section():
    toml = '[target]\npath = "a"  # c\n[data]\nx = 1\n'
    assert _set(toml, "target", 'path = "b"') == '[target]\npath = "b"\n[data]\nx = 1\n'
    assert _set(toml, "data", 'path = "d"') == '[target]\npath = "a"  # c\n[data]\npath = "d"\nx = 1\n'
    assert _set(toml, "topology", 'colocated_gpus = ["0"]').endswith('x = 1\n\n[topology]\ncolocated_gpus = ["0"]\n')


def test_the_readme_walk_through_runs_as_written_on_cpu(tmp_path):
    lines = _walk_through()
    assert lines[0] == "cp configs/qwen3.6-27b-8gpu.toml run.toml"
    preset = (ROOT / "configs/qwen3.6-27b-8gpu.toml").read_text(encoding="utf-8")
    # the three things the walk-through sets, set as a user would in the copy: the target (a folder of weights: this
    # preset's config.json, which the estimate reads, beside a small safetensors file standing in for the weights, whose
    # presence preflight's config check asks for: dflash.models.weights), the data (one small shard) and the GPUs (as
    # the comment says)
    settings = {m[1]: m[2] for m in (re.match(r"#\s+\[(\w+)\]\s+(\w+ = .*?)\s{2,}", line) for line in lines) if m}
    assert set(settings) == {"target", "data", "topology"}, settings
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_bytes((ROOT / "configs/targets/qwen3.6-27b/config.json").read_bytes())
    header = json.dumps({"stand_in": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(2))
    write_shard(tmp_path / "data" / "shard-00000.arrow", [[1, 2, 3, 4, 5] * 40] * 4, [[0, 1, 1, 1, 1] * 40] * 4)
    config = _set(preset, "target", f'path = "{model}"')
    config = _set(config, "data", f'path = "{tmp_path / "data"}"')
    config = _set(config, "topology", settings["topology"])
    (tmp_path / "run.toml").write_text(config, encoding="utf-8")

    estimate = next(line for line in lines if line.startswith("uv run dflash-estimate"))
    done = subprocess.run(_script(shlex.split(estimate, comments=True)), cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert re.search(r"(?m)^  fits +co-located data parallel over 8 GPUs: .*FSDP2: colocated", done.stdout), done.stdout

    preflight = next(line for line in lines if line.startswith("uv run dflash-preflight"))
    done = subprocess.run(_script(shlex.split(preflight, comments=True)), cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode in (0, 1), done.stderr  # 1 here: no GPU on the test machine; 2 would be a bad command line
    status = {check: verdict for verdict, check in re.findall(r"(?m)^(PASS|WARN|FAIL|SKIP)\s+(\S+)", done.stdout)}
    assert status["config"] == "PASS" and status["run-dir"] == "PASS", done.stdout
    assert status["dataset"] in ("PASS", "WARN"), done.stdout
