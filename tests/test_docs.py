"""The README and docs/ stay usable: relative links resolve, every page is reachable, and the
README's usage example runs as written.

Fast and CPU-only: the usage example is compiled with ``aot_eager`` (set through a
``./te_compile.toml`` in a temporary working directory, which is where the example says its config
comes from), so no inductor code generation is involved.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# [text](target) or ![alt](target), text possibly wrapped over lines; an optional "title" after the target
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^\s*(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_EXTERNAL = ("http://", "https://", "mailto:")


def _markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _prose(text: str) -> str:
    """``text`` with fenced code blocks and inline code spans blanked out, line breaks kept."""
    lines, in_fence = [], False
    for line in text.split("\n"):
        if _FENCE.match(line):
            in_fence = not in_fence
            lines.append("")
        elif in_fence:
            lines.append("")
        else:
            lines.append(_CODE_SPAN.sub(lambda m: " " * len(m.group(0)), line))
    return "\n".join(lines)


def _links(path: Path) -> list[tuple[int, str]]:
    """(line, target) of every Markdown link in ``path`` outside code."""
    prose = _prose(path.read_text(encoding="utf-8"))
    return [(prose.count("\n", 0, m.start()) + 1, m.group(1)) for m in _LINK.finditer(prose)]


def _relative_targets(path: Path) -> list[tuple[int, str, Path]]:
    """(line, link, resolved path) of the links that name a file or folder of this checkout."""
    out = []
    for line, target in _links(path):
        if target.startswith(_EXTERNAL) or target.startswith("#"):
            continue
        out.append((line, target, (path.parent / target.split("#", 1)[0]).resolve()))
    return out


def test_relative_links_resolve():
    files = _markdown_files()
    assert len(files) > 1, f"expected README.md and pages under {DOCS}, found {files}"
    broken, checked = [], 0
    for path in files:
        for line, target, resolved in _relative_targets(path):
            checked += 1
            if not resolved.exists():
                broken.append(f"{path.relative_to(ROOT)}:{line}: [{target}] -> {resolved} does not exist")
    assert checked > 0, "found no relative links at all: the link pattern no longer matches the docs"
    assert not broken, f"{len(broken)} of {checked} relative links do not resolve:\n" + "\n".join(broken)


def test_every_docs_page_is_linked_from_readme_and_index():
    pages = {p.resolve() for p in DOCS.glob("*.md")} - {(DOCS / "README.md").resolve()}
    missing = []
    for index in (README, DOCS / "README.md"):
        linked = {resolved for _, _, resolved in _relative_targets(index)}
        missing += [f"{index.relative_to(ROOT)} does not link {p.relative_to(ROOT)}"
                    for p in sorted(pages - linked)]
    benchmarks = (ROOT / "BENCHMARKS.md").resolve()
    if benchmarks not in {resolved for _, _, resolved in _relative_targets(README)}:
        missing.append("README.md does not link BENCHMARKS.md")
    assert not missing, "\n".join(missing)


def _usage_snippet() -> str:
    """The first ```python block of the README's "## Usage" section."""
    text = README.read_text(encoding="utf-8")
    section = re.search(r"^## Usage\s*$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert section, "README.md has no '## Usage' section"
    block = re.search(r"^```python\s*\n(.*?)^```", section.group(1), re.M | re.S)
    assert block, "the README's Usage section has no ```python block"
    return block.group(1)


# Appended to the example: what it computed, for the assertions below. The example must leave its
# training loss in ``loss``, as the README's does.
_EPILOGUE = """
import json as _json
print("TEST_DOCS_RESULT " + _json.dumps({
    "loss": float(loss),
    "sites": [[s.op, s.rewritten, s.recipe, s.reason] for s in te_compile.report().sites],
}))
"""


def test_readme_usage_example_runs(tmp_path):
    snippet = _usage_snippet()
    # The example reads its config from ./te_compile.toml; here that file only switches inductor off.
    (tmp_path / "te_compile.toml").write_text('compiler = "aot_eager"\n')
    env = {k: v for k, v in os.environ.items() if k != "TE_COMPILE_CONFIG"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", snippet + _EPILOGUE], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (f"the README's usage example failed (exit {proc.returncode}):\n"
                                  f"--- stdout\n{proc.stdout[-3000:]}\n--- stderr\n{proc.stderr[-6000:]}")
    marker = [line for line in proc.stdout.splitlines() if line.startswith("TEST_DOCS_RESULT ")]
    assert len(marker) == 1, f"no result line in the example's output:\n{proc.stdout[-3000:]}"
    result = json.loads(marker[0].split(" ", 1)[1])

    assert math.isfinite(result["loss"]), f"the example's loss is {result['loss']}"
    linears = [site for site in result["sites"] if site[0] == "linear"]
    assert linears, f"the report lists no linear site: {result['sites']}"
    not_rewritten = [site for site in linears if not site[1]]
    assert not not_rewritten, f"linear sites of the usage example left in high precision: {not_rewritten}"
    # the printed report is the table of those sites, ending in the overall count
    assert f"{sum(s[1] for s in result['sites'])} of {len(result['sites'])} sites rewritten" in proc.stdout, \
        f"the example did not print the report:\n{proc.stdout[-3000:]}"
