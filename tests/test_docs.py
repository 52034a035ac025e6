"""The front page and the docs stay true: generated pages match their JSON, links resolve, and
nothing in the repository points at a path outside it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# paths that exist only on some developer's machine: a sibling checkout, a scratch folder, a home
OUTSIDE = re.compile(r"\.\./shared|(?<![\w.])/(?:tmp|work|root|home)/")
TEXT_SUFFIXES = {".py", ".md", ".json", ".jsonl", ".sh", ".toml", ".txt", ".cfg", ".yml", ""}


def tracked_files() -> list[Path]:
    try:
        listed = subprocess.run(
            ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
        ).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    return [REPO / name for name in listed.decode().split("\0") if name]


def test_generated_pages_match_the_benchmark_json() -> None:
    done = subprocess.run(
        [sys.executable, str(REPO / "benchmarks" / "render_docs.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_no_path_outside_the_repository() -> None:
    offenders = []
    for path in tracked_files():
        if path.suffix not in TEXT_SUFFIXES or not path.is_file():
            continue
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            if OUTSIDE.search(line):
                offenders.append(f"{path.relative_to(REPO)}:{number}: {line.strip()[:100]}")
    assert not offenders, "\n".join(offenders)


def test_readme_is_a_front_page_whose_links_resolve() -> None:
    readme = REPO / "README.md"
    assert len(readme.read_text().splitlines()) <= 200
    broken = []
    for page in [readme, *sorted((REPO / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(([^)#\s]+)[^)]*\)", page.read_text()):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.relative_to(REPO)} -> {target}")
    assert not broken, "\n".join(broken)
