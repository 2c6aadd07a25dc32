"""No module of the package over MAX_LINES lines: past that, a module holds more than one idea and
a newcomer cannot find "where is X?" in one guess, where timm's one-concept-per-file layout
(``timm/data/loader.py``, ``timm/utils/checkpoint_saver.py``) lets them. Split along a real seam, not
by line count."""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "hvdtrain"
MAX_LINES = 400


def line_counts(root: Path) -> dict[str, int]:
    return {str(path.relative_to(REPO)): len(path.read_text(encoding="utf-8").splitlines())
            for path in sorted(root.rglob("*.py"))}


def test_the_check_reads_every_module_of_the_package():
    counts = line_counts(PACKAGE)
    assert len(counts) > 100 and "hvdtrain/train/trainer.py" in counts and all(counts.values())


def test_no_module_of_the_package_is_over_400_lines():
    over = {path: lines for path, lines in line_counts(PACKAGE).items() if lines > MAX_LINES}
    assert not over, f"modules over {MAX_LINES} lines (split each along a seam of its own):\n" + "\n".join(
        f"  {path}: {lines} lines" for path, lines in sorted(over.items(), key=lambda item: -item[1]))
