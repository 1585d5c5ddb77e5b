"""The documentation stays true to the code: every runnable snippet runs, every link resolves.

A Python snippet is runnable when its ```python fence comes right after a line
``<!-- runnable -->``. Each one runs in a fresh interpreter (this checkout's ckptd first on the
path, cwd a temporary directory), so it must be self-contained: most start their own local Ray
instance. Two run at a time (the next one starts while a test waits for its own), which halves
the file's wall time without piling Ray instances onto the machine.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
MARKER = "<!-- runnable -->"
README_MAX_LINES = 150
SNIPPET_TIMEOUT_S = 240


def doc_files() -> list[Path]:
    """The files whose links are checked: the README and everything under docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def snippet_files() -> list[Path]:
    """The files whose runnable snippets run: the docs, and deploy/README.md."""
    deploy = REPO / "deploy" / "README.md"
    return doc_files() + ([deploy] if deploy.exists() else [])


@dataclass(frozen=True)
class Snippet:
    path: Path
    line: int  # 1-based line of the ```python fence
    code: str

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def fences(text: str) -> list[tuple[int, str, str]]:
    """(fence line, info string, body) of every fenced block, 1-based lines."""
    out, lines, i = [], text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(```+)(.*)$", lines[i])
        if m is None:
            i += 1
            continue
        start, ticks, info = i, m.group(1), m.group(2).strip()
        i += 1
        while i < len(lines) and lines[i].strip() != ticks:
            i += 1
        out.append((start + 1, info, "\n".join(lines[start + 1:i]) + "\n"))
        i += 1
    return out


def runnable_snippets(path: Path) -> list[Snippet]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for line, info, body in fences(text):
        if info == "python" and line >= 2 and lines[line - 2].strip() == MARKER:
            found.append(Snippet(path, line, body))
    return found


def stray_markers(path: Path) -> list[int]:
    """Lines of markers not followed at once by a ```python fence: their snippet would never run."""
    lines = path.read_text().splitlines()
    return [i + 1 for i, text in enumerate(lines)
            if text.strip() == MARKER and (i + 1 >= len(lines) or lines[i + 1].strip() != "```python")]


SNIPPETS = [s for f in snippet_files() for s in runnable_snippets(f)]


class SnippetRunner:
    """Runs snippets in subprocesses, two at a time, the next one started while a test waits."""

    def __init__(self, snippets: list[Snippet], workdir: Path) -> None:
        self._order = [s.id for s in snippets]
        self._by_id = {s.id: s for s in snippets}
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="snippet")
        self._futures: dict[str, Future] = {}
        self._lock = threading.Lock()
        self._workdir = workdir
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # never join another cluster
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
        self._env = env

    def result(self, snippet_id: str) -> subprocess.CompletedProcess:
        i = self._order.index(snippet_id)
        with self._lock:
            for sid in self._order[i:i + 2]:
                if sid not in self._futures:
                    self._futures[sid] = self._pool.submit(self._run, self._by_id[sid])
            future = self._futures[snippet_id]
        return future.result()

    def _run(self, snippet: Snippet) -> subprocess.CompletedProcess:
        cwd = tempfile.mkdtemp(prefix="snippet-", dir=self._workdir)
        try:
            return subprocess.run([sys.executable, "-c", snippet.code], cwd=cwd, env=self._env,
                                  capture_output=True, text=True, timeout=SNIPPET_TIMEOUT_S)
        except subprocess.TimeoutExpired as e:
            return subprocess.CompletedProcess(e.cmd, -1, e.stdout or "",
                                               f"timed out after {SNIPPET_TIMEOUT_S} s\n{e.stderr or ''}")

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


@pytest.fixture(scope="module")
def runner(request, tmp_path_factory):
    # Only the snippets whose tests were selected (-k), in the order they run: nothing is run ahead in vain.
    selected = [item.callspec.params["snippet_id"] for item in request.session.items
                if getattr(item, "callspec", None) and "snippet_id" in item.callspec.params]
    r = SnippetRunner([s for sid in selected for s in SNIPPETS if s.id == sid], tmp_path_factory.mktemp("snippets"))
    yield r
    r.close()


@pytest.mark.parametrize("snippet_id", [s.id for s in SNIPPETS])
def test_runnable_snippet_runs(runner, snippet_id):
    proc = runner.result(snippet_id)
    assert proc.returncode == 0, (
        f"the runnable snippet at {snippet_id} failed (exit {proc.returncode}):\n"
        f"--- stderr ---\n{proc.stderr[-6000:]}\n--- stdout ---\n{proc.stdout[-2000:]}"
    )


# -- fast checks --------------------------------------------------------------------------------


def test_the_readme_has_a_runnable_snippet_and_is_a_landing_page():
    readme = REPO / "README.md"
    assert runnable_snippets(readme), "the README's 30-second example must be marked runnable"
    n = len(readme.read_text().splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; keep it a landing page (at most {README_MAX_LINES})"


def test_every_runnable_marker_is_followed_by_a_python_fence():
    stray = {str(f.relative_to(REPO)): lines for f in snippet_files() if (lines := stray_markers(f))}
    assert not stray, f"'{MARKER}' must come right before a ```python fence: {stray}"


def test_the_readme_keeps_the_test_command_ci_runs():
    """.ci/run runs the README's test command; both set-up commands stay in the README verbatim."""
    ci = [ln.strip() for ln in (REPO / ".ci" / "run").read_text().splitlines()]
    command = [ln for ln in ci if ln.startswith("python3 -m venv .venv")]
    assert len(command) == 1, ".ci/run should hold exactly one venv + pytest command"
    bash = [body for _, info, body in fences((REPO / "README.md").read_text()) if info == "bash"]
    bash_lines = {ln.strip() for body in bash for ln in body.splitlines()}
    assert command[0] in bash_lines
    assert any(ln.endswith(".venv/bin/ckptd demo") and ln.startswith("python3 -m venv .venv") for ln in bash_lines)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = path.read_text()
    in_code = {ln for start, _, body in fences(text) for ln in range(start, start + body.count("\n") + 2)}
    seen: dict[str, int] = {}
    out = set()
    for i, line in enumerate(text.splitlines(), 1):
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m is None or i in in_code:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")


def links(path: Path) -> list[tuple[int, str]]:
    text = path.read_text()
    in_code = {ln for start, _, body in fences(text) for ln in range(start, start + body.count("\n") + 2)}
    out = []
    for i, line in enumerate(text.splitlines(), 1):
        if i in in_code:
            continue
        line = re.sub(r"`[^`]*`", "", line)  # code spans are not links
        out.extend((i, m.group(1)) for m in LINK.finditer(line))
    return out


def test_every_relative_link_and_image_resolves():
    broken = []
    for doc in doc_files():
        for line, target in links(doc):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
                continue
            where = f"{doc.relative_to(REPO)}:{line}: {target}"
            file_part, _, anchor = target.partition("#")
            dest = (doc.parent / file_part).resolve() if file_part else doc
            if not dest.exists():
                broken.append(f"{where} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_checks_see_the_docs():
    """Guards against a parser that finds nothing, which would make the checks above pass vacuously."""
    assert len(SNIPPETS) >= 4
    assert sum(len(links(d)) for d in doc_files()) >= 20
    assert "the-contract" in anchors(REPO / "docs" / "contract.md")
