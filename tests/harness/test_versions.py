"""Version sets and command-line pins: valid input resolves, bad input is one line and exit code 2."""

import json
import pytest

from stackcheck import cli
from stackcheck.core.versions import LIBRARIES, UsageError, load_sets, parse_pin, resolve


def test_every_named_set_pins_every_library_exactly():
    sets, default = load_sets()
    assert {"seed", "latest"} <= set(sets) and default in sets
    assert sets["seed"].requirements() == [
        "transformers==5.6.2", "peft==0.19.1", "accelerate==1.13.0", "bitsandbytes==0.49.2"
    ]
    for vset in sets.values():
        assert [pin.package for pin in vset.pins.values()] == list(LIBRARIES)


def test_an_opt_in_set_runs_only_when_named():
    """t4 (the last transformers 4.x) writes checkpoints for a 5.x set to read: `--sets t4,latest`, never one of
    every set (the matrix without --sets and its CI jobs) nor the tests' default."""
    sets, default = load_sets()
    assert sets["t4"].opt_in and not sets[default].opt_in and sets["t4"].pins["transformers"].version.startswith("4.")
    assert "t4" not in [vset.name for vset in resolve()] and "seed" in [vset.name for vset in resolve()]
    assert [vset.name for vset in resolve(["t4", "latest"])] == ["t4", "latest"]


def test_ad_hoc_set_is_a_base_set_plus_overrides(tmp_path):
    wheel = tmp_path / "bitsandbytes-0.51.0.dev0-py3-none-any.whl"
    wheel.touch()
    (adhoc,) = resolve(["seed"], ["accelerate==1.14.0", f"bitsandbytes={wheel}", "peft@git+https://github.com/huggingface/peft@main"])
    assert adhoc.name.startswith("seed+accelerate==1.14.0+")
    assert adhoc.pins["accelerate"].requirement() == "accelerate==1.14.0"
    assert adhoc.pins["bitsandbytes"].requirement() == f"bitsandbytes @ {wheel.as_uri()}"
    assert adhoc.pins["peft"].requirement() == "peft @ git+https://github.com/huggingface/peft@main"
    assert adhoc.pins["transformers"].requirement() == "transformers==5.6.2"


@pytest.mark.parametrize(
    "token, message",
    [
        ("peft", "bad pin 'peft'"),
        ("peft==not.a.version!", "is not a valid version"),
        ("numpy==2.0", "unknown package 'numpy'"),
        ("peft=/no/such/path", "NAME=PATH names a file or folder, and /no/such/path does not exist"),
        ("peft@ftp:/x", "expected a URL"),
    ],
)
def test_malformed_pins_name_the_bad_token(token, message):
    with pytest.raises(UsageError, match=message):
        parse_pin(token)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["versions", "--sets", "nosuchset"], "stackcheck: unknown set 'nosuchset' (valid sets: seed, latest, t4, current)"),
        (["versions", "--with", "peft==x.y!"], "stackcheck: bad pin 'peft==x.y!': 'x.y!' is not a valid version"),
        (["matrix", "--sets", "seed,typo"], "stackcheck: unknown set 'typo' (valid sets: seed, latest, t4, current)"),
    ],
)
def test_user_errors_print_one_line_and_exit_2(argv, message, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err.strip() == message


def test_trl_is_pinnable_with_with_and_in_a_set(tmp_path):
    """trl is what users run beside the libraries: `--with trl==X` pins it, a set in sets.toml may pin it, and the
    installed versions (the report header, matrix.md's columns) name it."""
    from stackcheck.runner import envs
    from stackcheck.core import results, versions

    (adhoc,) = resolve(["seed"], ["trl==1.13.0"])
    assert adhoc.pins["trl"].requirement() == "trl==1.13.0"
    assert "trl==1.13.0" not in envs.test_requirements(adhoc)  # the set's own pin replaces the extra's
    assert any(req.startswith("trl==") for req in envs.test_requirements(resolve(["seed"])[0]))
    sets_file = tmp_path / "sets.toml"
    sets_file.write_text('default = "s"\n[sets.s]\ntransformers = "5.6.2"\npeft = "0.19.1"\naccelerate = "1.13.0"\n'
                         'bitsandbytes = "0.49.2"\ntrl = "1.16.0"\n')
    assert load_sets(sets_file)[0]["s"].pins["trl"].requirement() == "trl==1.16.0"
    assert "trl" in versions.installed_versions() and "trl" in results.VERSION_COLUMNS


def test_a_set_crosses_the_boundary_as_a_record_and_comes_back_whole():
    """The runner hands the child the set it resolved (protocol.SET_RECORD_ENV), pins included, not a name to rebuild."""
    from stackcheck.core.versions import VersionSet, resolve

    for vset in resolve(["seed"], ["peft==0.20.0"]) + resolve(["latest"]):
        assert VersionSet.from_dict(json.loads(json.dumps(vset.to_dict()))) == vset
