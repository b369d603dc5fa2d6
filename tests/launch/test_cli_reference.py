"""docs/cli.md is what the argument parser says: regenerate it after changing a flag."""

from pathlib import Path

from strata.launch.cli.reference import REGENERATE, cli_reference

CLI_MD = Path(__file__).parents[2] / "docs" / "cli.md"


def test_docs_cli_md_is_the_parsers_reference() -> None:
    assert CLI_MD.read_text() == cli_reference(), f"docs/cli.md is stale: run `{REGENERATE}` from the repository root"
