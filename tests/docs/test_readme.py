"""The README sets a fresh machine up with exactly two commands, ``make demo`` and ``make test``, and its tenant-CLI
paragraph names only commands the CLI has."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


def test_fresh_machine_section_has_exactly_make_demo_and_make_test():
    section = README.read_text().split("## On a fresh machine", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(blocks) == 1
    commands = [line.split("#", 1)[0].strip() for line in blocks[0].splitlines() if line.split("#", 1)[0].strip()]
    assert commands == ["make demo", "make test"]


def test_tenant_cli_commands_in_the_readme_exist(capsys):
    from loraplex.cli import main

    text = README.read_text()
    named = set(re.findall(r"`loraplex (adapters|keys) ([a-z]+)", text))
    assert {("adapters", "upload"), ("adapters", "list"), ("keys", "list")} <= named
    for group, command in sorted(named):
        with pytest.raises(SystemExit) as e:
            main([group, command, "--help"])
        assert e.value.code == 0, (group, command)
    capsys.readouterr()
