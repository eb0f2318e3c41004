"""The command line as its users read it: every option's help states its default, --version,
--threads' range, --debug before or after the command (issue 52)."""
import argparse
import re

import pytest

import sapwood
from sapwood import cli
from sapwood.cli import build_parser, main


def _parsers(p, name="sapwood"):
    """(name, parser) of the command and every subcommand, nested ones included."""
    yield name, p
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub, sp in action.choices.items():
                yield from _parsers(sp, f"{name} {sub}")


def _entries(help_text: str) -> dict:
    """Each argument's help entry, by its first option string (or name), on one line."""
    out, cur = {}, None
    for line in help_text.splitlines():
        m = re.match(r"^  (\S+)", line)
        if m:
            cur = m.group(1).rstrip(",")
            out[cur] = line
        elif cur is not None and line.startswith("    "):
            out[cur] += " " + line
        else:
            cur = None
    return {k: " ".join(v.split()) for k, v in out.items()}


def test_every_option_states_its_default_and_choices():
    checked = 0
    for name, p in _parsers(build_parser()):
        entries = _entries(p.format_help())
        for a in p._actions:
            if isinstance(a, (argparse._HelpAction, argparse._VersionAction,
                              argparse._SubParsersAction)):
                continue
            if not a.option_strings and a.nargs != "?":
                continue  # a required positional has no default
            entry = entries[(a.option_strings or [a.dest])[0]]
            assert "(default" in entry, f"{name}: {entry}"
            if "(default" not in (a.help or "") and a.default not in (None, False):
                assert f"(default: {a.default})" in entry, f"{name}: {entry}"
            for c in a.choices or ():
                assert str(c) in entry, f"{name}: {entry}"
            checked += 1
    assert checked > 80  # generate, inspect, serve and the three benchmarks


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert re.fullmatch(r"sapwood \d+\.\d+\S*\n", out), out
    assert out == f"sapwood {cli.version()}\n"


def test_version_without_the_distribution_is_the_package_s(monkeypatch):
    from importlib import metadata

    def missing(name):
        raise metadata.PackageNotFoundError(name)

    monkeypatch.setattr(metadata, "version", missing)
    assert cli.version() == sapwood.__version__


@pytest.mark.parametrize("cmd", [["generate", "x"], ["serve"], ["bench", "ab"]])
@pytest.mark.parametrize("bad", ["0", "-2", str(cli.MAX_THREADS + 1), "two", "1.5"])
def test_threads_out_of_range_exits_2_naming_the_value(capsys, cmd, bad):
    with pytest.raises(SystemExit) as e:  # parsed only: a value let through runs nothing
        build_parser().parse_args([*cmd, "--threads", bad])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--threads" in err and repr(bad) in err, err


def test_threads_in_range():
    for n in (1, cli.MAX_THREADS):
        assert build_parser().parse_args(["generate", "x", "--threads", str(n)]).threads == n


@pytest.mark.parametrize("argv", [["--debug", "generate", "x"], ["generate", "--debug", "x"],
                                  ["generate", "x", "--debug"], ["--debug", "bench", "ab"],
                                  ["bench", "--debug", "ab"], ["bench", "ab", "--debug"],
                                  ["inspect", "d", "--debug"], ["serve", "--debug"]])
def test_debug_before_or_after_the_command(argv):
    assert build_parser().parse_args(argv).debug is True
    assert build_parser().parse_args([x for x in argv if x != "--debug"]).debug is False


def test_debug_after_the_command_shows_the_traceback(tmp_path):
    from sapwood.testing import make_tiny_checkpoint

    make_tiny_checkpoint(tmp_path / "m", seed=4)
    with pytest.raises(ValueError, match="max_tokens"):
        main(["generate", "x", "--model", str(tmp_path / "m"), "--max-tokens", "0", "--debug"])
