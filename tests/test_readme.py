"""The README is for users: every file it names is in the project (it named DESIGN.md, kept
outside the tree), every figure comes with the command that reproduces it, and no internal
session or issue numbers ("stop 47", "issue 39") stand in for an explanation."""
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")
# a checkpoint's files, which the README describes, not the project's
CHECKPOINT_FILES = {"config.json", "tokenizer_config.json", "generation_config.json",
                    "tokenizer.json", "model.safetensors"}
TOP = ("csrc", "python", "bench", "docs", "scripts", "tests", "metal", "sycl", "emu", ".ci")


def named_paths(text):
    """Project paths the text names: under a top-level folder, or a bare *.md/*.py/... name.
    A path from the user's own machine (/tmp/..., ./..., dist/...) is not the project's."""
    out = set()
    for m in re.finditer(r"(?<![\w/.~-])(\.?[\w-]+(?:[/.][\w*-]+)*/?)", text):
        p = m.group(1).rstrip(".")
        top = p.split("/")[0]
        if top in TOP and "/" in p or re.fullmatch(r"[\w-]+\.(md|py|json|sh|toml)", p):
            out.add(p)
    return out


def test_every_file_the_readme_names_is_in_the_project():
    paths = named_paths(README)
    assert {"docs/design.md", "docs/server.md", "bench/load.py", ".ci/run"} <= paths
    missing = [p for p in sorted(paths - CHECKPOINT_FILES)
               if not any(ROOT.glob(p)) and not (ROOT / p).exists()
               and not any(ROOT.glob("*/" + p)) and not any(ROOT.glob("*/*/" + p))]
    assert missing == [], missing


def test_named_paths_finds_a_missing_file():
    assert "docs/nowhere.md" in named_paths("see docs/nowhere.md.")
    assert "DESIGN.md" in named_paths("the contract is DESIGN.md's")
    assert not named_paths("/tmp/padded ./x/y.md https://example.com/a.py")


def test_every_figure_has_its_command_and_no_internal_numbers():
    table = README.split("## Current figures")[1].split("\n## ")[0]
    rows = [r for r in table.splitlines() if r.startswith("| ") and not r.startswith("| what")]
    assert len(rows) >= 5
    for r in rows:
        assert "`" in r.rstrip(" |").rsplit("|", 1)[1], f"no command: {r[:60]}"
    assert not re.search(r"\b(stop|issue)s? \d+", README, re.I), \
        re.search(r".{30}\b(stop|issue)s? \d+.{10}", README, re.I).group(0)


def test_the_python_api_example_runs_as_written(capsys):
    """The README's Python API block, word for word, on the bundled pair (offline)."""
    import warnings

    block = re.search(r"## Python API\n\n```python\n(.*?)```", README, re.S).group(1)
    scope: dict = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bundled pair's ChatML notice
        exec(compile(block, "README.md", "exec"), scope)
    r1, r2, session = scope["r1"], scope["r2"], scope["session"]
    assert session.continued == len(scope["ids"]) + len(r1.tokens) - 1 > 0
    model, ids = scope["model"], scope["ids"]
    assert r2.tokens == model.generate(ids + r1.tokens + model.encode("\n\n"), max_tokens=32).tokens
    assert scope["stream"].result.text in capsys.readouterr().out  # the pieces, printed
