"""The front door stays a front door: the README is short, its lines readable, its measured
figures traceable to docs/measurements.md, its architecture diagram names every module, and every
link in it and in docs/ leads to a file that exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit
REPO = Path(__file__).parent.parent
README = REPO / "README.md"
MAX_LINES, MAX_WIDTH = 250, 120  # as the field's READMEs keep it (100-300 lines)
PACKAGES = ("pipeline", "eval", "release", "model_card")


def test_the_readme_is_short_and_its_lines_readable():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"README.md has {len(lines)} lines: move depth to docs/"
    wide = [line[:40] for line in prose(README.read_text()).splitlines() if len(line) > MAX_WIDTH]
    assert not wide, f"README.md lines over {MAX_WIDTH} characters, outside code: {wide}"


def prose(text: str) -> str:
    """``text`` without its code blocks."""
    return "".join(text.split("```")[::2])


def test_every_measured_figure_in_the_readme_is_in_the_measurements_log():
    """A decimal figure (not a version) in the README's prose is a measurement: it must be in
    docs/measurements.md, where it has a date, a machine and a command."""
    figures = set(re.findall(r"(?<![\d.])\d+\.\d+(?![\d.])", prose(README.read_text())))
    log = (REPO / "docs" / "measurements.md").read_text()
    untraced = sorted(f for f in figures if f not in log)
    assert not untraced, f"README.md figures not in docs/measurements.md: {untraced}"


def test_the_architecture_diagram_names_every_module():
    text = README.read_text()
    diagram = text[text.index("### Architecture") :].split("```")[1]
    names = set(re.findall(r"[a-z_]+", diagram))
    modules = {
        p.stem if p.name != "__init__.py" else p.parent.name
        for package in PACKAGES
        for p in (REPO / package).rglob("*.py")
        if p.name != "__main__.py" and "__pycache__" not in p.parts
    }
    missing = sorted(modules - names - set(PACKAGES) - {"core", "serving", "training", "tools"})
    assert not missing, f"README.md's architecture diagram does not name {missing}"


@pytest.mark.parametrize(
    "page", [README, *sorted((REPO / "docs").glob("*.md"))], ids=lambda p: p.name
)
def test_every_link_leads_to_a_file(page):
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text())
    local = [link for link in links if not re.match(r"[a-z]+://", link)]
    broken = [link for link in local if not (page.parent / link).exists()]
    assert not broken, f"{page.relative_to(REPO)} links to missing files: {broken}"
