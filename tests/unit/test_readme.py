"""The README documents every config key with its current default."""

from pathlib import Path

from hvdtrain.config import describe_keys

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


def test_every_config_key_is_in_the_readme_with_its_default():
    for key, _, default, _ in describe_keys():
        shown = repr(default) if isinstance(default, str) else str(default).lower() if isinstance(default, bool) else default
        assert f"| `{key}` |" in README, key
        assert f"`{shown}`" in README.split(f"| `{key}` |", 1)[1].split("\n", 1)[0], key


def test_quick_start_is_two_make_commands():
    quick = README.split("## Quick start", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    assert [line.split()[0:2] for line in quick.strip().splitlines()] == [["make", "demo"], ["make", "test"]]
