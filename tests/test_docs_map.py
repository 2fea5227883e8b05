"""docs/architecture.md stays a one-page map: at most 1,500 words, and every file or folder it names exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAP = ROOT / "docs" / "architecture.md"
MAX_WORDS = 1500


def named_paths(text: str) -> set[str]:
    """Every `code span` outside code blocks that is a path: it has a slash or a file suffix, and no space."""
    prose = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    spans = re.findall(r"`([^`\n]+)`", prose)
    return {s for s in spans if " " not in s and ("/" in s or re.search(r"\.(py|md|toml|sh)$", s))}


def test_every_path_the_map_names_exists():
    paths = named_paths(MAP.read_text())
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert missing == []
    assert "pdserve/scheduler/scheduler.py" in paths  # the walk sees the paths it checks


def test_the_map_is_one_page():
    assert len(MAP.read_text().split()) <= MAX_WORDS


def test_paths_are_found():
    text = "see `pdserve/llm.py`, `docs/pd.md` and `kv_done`, not `from pdserve import LLM`\n```\n`x/y.py`\n```"
    assert named_paths(text) == {"pdserve/llm.py", "docs/pd.md"}
