"""The README's settings table against the package: every environment variable
the package reads has a row, and every row names one it reads."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _settings_rows() -> set[str]:
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    return set(re.findall(r"^\| `(VLLM_DSA_VARLEN[A-Z0-9_]*)` \|", section, re.M))


def _variables_read() -> set[str]:
    found = set()
    for path in (ROOT / "vllm_dsa_varlen").rglob("*.py"):
        found.update(re.findall(r"\"(VLLM_DSA_VARLEN[A-Z0-9_]*)\"", path.read_text()))
    return found


def test_every_setting_has_one_row():
    rows, read = _settings_rows(), _variables_read()
    assert rows, "README: no settings table found"
    assert read - rows == set(), "read by the package but not in README's settings table"
    assert rows - read == set(), "in README's settings table but read nowhere"
