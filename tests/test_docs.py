"""The manual (docs/, built by MkDocs) builds, lists every page, and its examples run.

How a page's fenced blocks are treated (the rule the guides are written to):

- a ```python block runs; a page's blocks run in order in one namespace, in a fresh temporary
  directory (later blocks use what earlier ones made, as a reader would);
- a ```bash block runs with ``bash -euo pipefail`` in that same directory, where ``mlx-train``
  and ``python`` are this checkout's;
- any other block (yaml, json, text) is not run;
- an HTML comment on the line before a fence changes that, and is read by this test:
  ``<!-- docs-test: skip REASON -->`` leaves a python/bash block out (the reason is required:
  it needs several machines, a download, a tracker server...);
  ``<!-- docs-test: file NAME -->`` writes the block to NAME before the page's blocks run
  (a YAML config, jsonl rows, a script), so a later block can use it; the block itself is not run.

Running the blocks launches a process per page and trains small models, so those tests are
``slow``; the structure checks (nav, markers, syntax, documented CLI flags) are fast. Run as a
script (``python tests/test_docs.py SPEC.json RESULTS.json``) this file is the page runner.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
MARKER = re.compile(r"<!--\s*docs-test:\s*(?P<verb>\S+)\s*(?P<arg>.*?)\s*-->")
RUNNABLE = ("python", "bash")


@dataclass
class Block:
    page: str        # path relative to docs/ (or "README.md")
    line: int        # line of the opening fence
    language: str
    code: str
    marker: tuple[str, str] | None  # (verb, argument) of a docs-test comment on the line before

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"

    @property
    def runs(self) -> bool:
        return self.language in RUNNABLE and self.marker is None


def blocks_of(text: str, page: str) -> list[Block]:
    """Every fenced block of a Markdown text, with the docs-test marker on the line before it."""
    blocks: list[Block] = []
    lines = text.splitlines()
    current: list[str] | None = None
    start, language, marker = 0, "", None
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if current is None and stripped.startswith("```"):
            language = stripped[3:].strip().split(" ")[0]
            previous = lines[number - 2].strip() if number >= 2 else ""
            match = MARKER.fullmatch(previous)
            marker = (match["verb"], match["arg"]) if match else None
            current, start = [], number
        elif current is not None and stripped == "```":
            blocks.append(Block(page, start, language, "\n".join(current) + "\n", marker))
            current = None
        elif current is not None:
            current.append(line)
    assert current is None, f"{page}:{start}: a ``` fence is never closed"
    return blocks


def pages() -> list[Path]:
    return sorted(DOCS.rglob("*.md"))


def page_blocks(page: Path) -> list[Block]:
    return blocks_of(page.read_text(encoding="utf-8"), str(page.relative_to(DOCS)))


def nav_pages() -> list[str]:
    """The page files mkdocs.yml's nav lists (without loading its YAML tags)."""
    return re.findall(r":\s*([\w/.-]+\.md)\s*$", (ROOT / "mkdocs.yml").read_text(), flags=re.MULTILINE)


# --- structure (fast) ------------------------------------------------------------------------------


def test_every_page_is_in_the_nav_and_every_nav_entry_exists():
    listed = nav_pages()
    assert listed, "mkdocs.yml has no nav entries: did its layout change?"
    on_disk = {str(p.relative_to(DOCS)) for p in pages()}
    missing = sorted(on_disk - set(listed))
    assert not missing, f"pages not in mkdocs.yml's nav (a reader cannot reach them): {missing}"
    absent = sorted(set(listed) - on_disk)
    assert not absent, f"mkdocs.yml's nav lists pages that do not exist: {absent}"
    guides = {p for p in on_disk if p.startswith("guides/")}
    assert {"guides/training.md", "guides/resume.md", "guides/distributed.md", "guides/memory.md",
            "guides/monitoring.md", "guides/finetuning.md", "guides/export.md"} <= guides


def test_markers_are_known_and_each_stands_before_a_block():
    assert pages(), "docs/ has no pages"
    problems = []
    for page in pages():
        text = page.read_text(encoding="utf-8")
        lines = text.splitlines()
        for number, line in enumerate(lines, start=1):
            match = MARKER.fullmatch(line.strip())
            if line.strip().startswith("<!--") and "docs-test" in line and not match:
                problems.append(f"{page.name}:{number}: malformed docs-test comment: {line.strip()}")
                continue
            if not match:
                continue
            verb, arg = match["verb"], match["arg"]
            following = lines[number].strip() if number < len(lines) else ""
            if not following.startswith("```"):
                problems.append(f"{page.name}:{number}: a docs-test comment must be on the line before a ``` fence")
            if verb not in ("skip", "file"):
                problems.append(f"{page.name}:{number}: unknown docs-test verb {verb!r} (skip REASON, file NAME)")
            elif not arg:
                problems.append(f"{page.name}:{number}: 'docs-test: {verb}' needs "
                                f"{'a reason' if verb == 'skip' else 'a file name'}")
    assert not problems, "\n".join(problems)


def test_runnable_blocks_parse():
    blocks = [b for page in pages() for b in page_blocks(page) if b.language in RUNNABLE]
    assert len([b for b in blocks if b.runs]) >= 15, "the guides have (almost) no runnable blocks left"
    for block in blocks:
        if block.language == "python":
            compile(block.code, block.where, "exec")  # a syntax error names the block's line
        else:
            check = subprocess.run(["bash", "-n"], input=block.code, text=True, capture_output=True)
            assert check.returncode == 0, f"{block.where}: bash syntax error:\n{check.stderr}"


def _mlx_train_commands(code: str) -> list[tuple[str, list[str]]]:
    """(subcommand, its --flags) of each ``mlx-train`` command line in a shell block."""
    found = []
    for line in code.replace("\\\n", " ").splitlines():
        line = line.split(" #", 1)[0]
        for part in re.split(r"&&|\|\||;|\|", line):
            try:
                words = shlex.split(part)
            except ValueError:
                continue
            words = [w for w in words if not re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", w)]  # VAR=value prefixes
            if len(words) >= 2 and words[0] == "mlx-train" and not words[1].startswith("-"):
                found.append((words[1], [w.split("=", 1)[0] for w in words[2:] if w.startswith("--")]))
    return found


def test_documented_cli_flags_exist():
    """Every ``--flag`` an ``mlx-train CMD`` line of the manual or README uses is one ``CMD --help`` lists,
    skipped blocks included (a renamed flag shows up here, not in a reader's terminal)."""
    texts = [(b.where, b.code) for page in pages() for b in page_blocks(page) if b.language == "bash"]
    texts += [(b.where, b.code) for b in blocks_of(README.read_text(encoding="utf-8"), "README.md")
              if b.language == "bash"]
    uses: dict[str, set[tuple[str, str]]] = {}
    for where, code in texts:
        for command, flags in _mlx_train_commands(code):
            uses.setdefault(command, set()).update((flag, where) for flag in flags)
    assert {"train", "finetune", "export", "monitor"} <= set(uses), f"commands documented: {sorted(uses)}"
    from mlx_train.cli.main import main  # --help loads none of the training stack

    unknown = []
    for command, flags in sorted(uses.items()):
        shown = io.StringIO()
        with contextlib.redirect_stdout(shown):
            code = main([command, "--help"])
        assert code == 0, f"mlx-train {command} --help failed (exit {code}):\n{shown.getvalue()[-2000:]}"
        known = set(re.findall(r"--[a-z][a-z0-9-]*", shown.getvalue()))
        unknown += [f"{where}: mlx-train {command} {flag}" for flag, where in sorted(flags) if flag not in known]
    assert not unknown, "flags the docs use that --help does not list:\n" + "\n".join(unknown)


def test_readme_set_up_commands_are_the_manuals():
    """The README's set-up commands appear, word for word, on the manual's getting-started page."""
    readme = [b.code for b in blocks_of(README.read_text(encoding="utf-8"), "README.md") if b.language == "bash"]
    manual = {b.code for b in page_blocks(DOCS / "getting-started.md") if b.language == "bash"}
    set_up = ('pip install -e ".[examples]" && mlx-train train\n', 'pip install -e ".[dev]" && python -m pytest -q\n')
    for command in set_up:
        assert command in readme, f"README.md lost its set-up command {command.strip()!r}"
        assert command in manual, f"docs/getting-started.md lacks the README's set-up command {command.strip()!r}"


def test_readme_links_into_the_manual_resolve():
    links = re.findall(r"\]\((docs/[^)#\s]+)", README.read_text(encoding="utf-8"))
    assert len(links) >= 7, "README.md should link into the manual's guides"
    missing = [link for link in links if not (ROOT / link).is_file()]
    assert not missing, f"README.md links to pages that do not exist: {missing}"


# --- build and examples (slow) ------------------------------------------------------------------


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    """`mkdocs build --strict` passes: no broken link, no page outside the nav, every API object found."""
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=300,
                           env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout[-3000:]}\n{build.stderr[-6000:]}"
    assert (tmp_path / "site" / "reference" / "training" / "index.html").read_text().count("Trainer") > 5


def _run_page(page: Path, workdir: Path) -> dict[int, str | None]:
    blocks = page_blocks(page)
    for block in blocks:
        if block.marker and block.marker[0] == "file":
            target = workdir / block.marker[1]
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(block.code)
    shims = workdir / ".bin"
    shims.mkdir()
    for name, argv in (("mlx-train", "-m mlx_train.cli.main"), ("python", "")):
        shim = shims / name
        shim.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} {argv} "$@"\n')
        shim.chmod(0o755)
    spec = workdir / ".blocks.json"
    spec.write_text(json.dumps([[b.line, b.language, b.code] for b in blocks if b.runs]))
    out = workdir / ".results.json"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1", "MLX_TRAIN_HOME": str(workdir / ".home"),
           "PATH": f"{shims}{os.pathsep}{os.environ.get('PATH', '')}",
           "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, __file__, str(spec), str(out)], cwd=workdir, env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"the page runner crashed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return {int(line): error for line, error in json.loads(out.read_text()).items()}


def _runnable_pages() -> list[Path]:
    return [p for p in pages() if any(b.runs for b in page_blocks(p))]


@pytest.mark.slow
@pytest.mark.parametrize("doc_page", _runnable_pages(), ids=lambda p: str(p.relative_to(DOCS)))
def test_page_blocks_run(doc_page, tmp_path):
    """Every runnable block of the page runs without error (each failure is listed with its line)."""
    results = _run_page(doc_page, tmp_path)
    expected = [b for b in page_blocks(doc_page) if b.runs]
    failures = [f"{b.where} never ran" if b.line not in results
                else f"{b.where} ({b.language}) failed:\n{results[b.line]}"
                for b in expected if b.line not in results or results[b.line] is not None]
    assert not failures, "\n\n".join(failures)


# --- the page runner ---------------------------------------------------------------------------


def _main(spec_path: str, results_path: str) -> None:
    import traceback

    import mlx_train  # noqa: F401  (before mlx.core: BLAS preload)

    namespace: dict = {"__name__": "__main__"}
    results: dict[int, str | None] = {}
    for line, language, code in json.loads(Path(spec_path).read_text()):
        print(f"--- line {line} ({language})", flush=True)
        if language == "python":
            try:
                exec(compile(code, f"<block at line {line}>", "exec"), namespace)
                results[line] = None
            except BaseException:  # noqa: B036 (SystemExit from a block is a failure of that block too)
                lines = [t for t in traceback.format_exc().splitlines() if t.strip(" ^~")]
                results[line] = "\n".join(lines[-12:])
        else:
            ran = subprocess.run(["bash", "-euo", "pipefail", "-c", code], capture_output=True, text=True,
                                 stdin=subprocess.DEVNULL, timeout=600)
            results[line] = None if ran.returncode == 0 else (
                f"exit {ran.returncode}\n{ran.stdout[-2000:]}\n{ran.stderr[-3000:]}")
        Path(results_path).write_text(json.dumps(results))  # after each block: a crash keeps what ran


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
