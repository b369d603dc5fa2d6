"""The README's layout table names every top-level folder of the repository, and only those."""

import re
from pathlib import Path

REPO = Path(__file__).parents[2]
LOCAL_ONLY = {"build", "dist", "__pycache__"}  # made by builds and imports, ignored by git


def layout_table_folders() -> set[str]:
    section = REPO.joinpath("README.md").read_text().split("## Layout", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| `")]
    return {name.rstrip("/") for row in rows for name in re.findall(r"`([^`]+/)`", row.split("|")[1])}


def test_the_readme_layout_table_matches_the_top_level_folders():
    folders = {
        path.name for path in REPO.iterdir()
        if path.is_dir() and not path.name.startswith(".") and not path.name.endswith(".egg-info")
    } - LOCAL_ONLY
    assert layout_table_folders() == folders
