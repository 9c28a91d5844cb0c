"""The generated pages of docs/ are current (issue 32): docs/commands.md is what stackcheck's parser says, and
docs/families.md what the ledger and each family module's docstring say. Regenerate them with
`python -m stackcheck docs` (nox -s docs)."""

import pytest

from stackcheck import REPO_ROOT, cli
from stackcheck.commands import docgen
from stackcheck.core.ledger import Ledger, family_paths


@pytest.mark.parametrize("name", sorted(docgen.pages(cli._parser())))
def test_a_generated_page_is_current(name):
    committed = (REPO_ROOT / "docs" / name).read_text()
    assert committed == docgen.pages(cli._parser())[name], f"docs/{name} is not current: run `python -m stackcheck docs` (nox -s docs)"


def test_the_commands_page_has_every_command_and_option():
    parser = cli._parser()
    page = docgen.commands_page(parser)
    commands = parser._subparsers._group_actions[0].choices
    for name, sub in commands.items():
        assert f"\n## {name}\n" in page
        for action in sub._actions:
            if action.option_strings and action.help != "==SUPPRESS==" and action.option_strings[0] != "-h":
                assert f"`{action.option_strings[0]}`" in page, f"{name} {action.option_strings[0]}"


def test_the_families_page_has_every_family_with_its_modules_first_sentence():
    page = docgen.families_page()
    ledger = Ledger()
    paths = family_paths()
    for family in ledger.families.values():
        path = paths[family.id].relative_to(REPO_ROOT).as_posix()
        row = next(line for line in page.splitlines() if line.startswith(f"| [`{family.id}`](../{path})"))
        assert ("contract: " if "tests/contract/" in path else "| bug |") in row


def test_first_sentence_is_the_docstrings_first_sentence():
    assert docgen.first_sentence("`merge_and_unload()` into a 4-bit base diverges.\n\nSymptom: ...") == \
        "`merge_and_unload()` into a 4-bit base diverges."
    assert docgen.first_sentence("A test of Gemma 4's towers, wrapped\nover two lines. Then more.") == \
        "A test of Gemma 4's towers, wrapped over two lines."
    assert docgen.first_sentence("No sentence end: a title") == "No sentence end: a title"


def test_docgen_names_a_stale_page(tmp_path):
    for name, text in docgen.pages(cli._parser()).items():
        (tmp_path / name).write_text(text)
    (tmp_path / "families.md").write_text("stale\n")
    assert docgen.stale(cli._parser(), tmp_path) == ["families.md"]
