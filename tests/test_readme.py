"""The README's settings table against the package's one table of settings
(:data:`vllm_dsa_varlen.settings.SETTINGS`): a row per setting, in its order,
each listing the values the setting takes."""

import pathlib
import re

from vllm_dsa_varlen import settings

ROOT = pathlib.Path(__file__).resolve().parent.parent
WHAT_TO_DO = ("regenerate README's settings table with `python -m vllm_dsa_varlen.settings` "
              "(the table lives in vllm_dsa_varlen/settings.py)")


def _settings_rows() -> list[tuple[str, str]]:
    """(variable, values column) of each row of README's settings table."""
    text = (ROOT / "README.md").read_text()
    assert "\n## Settings\n" in text, "README: no '## Settings' section"
    section = text.split("\n## Settings\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `((?:VLLM_)?DSA_VARLEN[A-Z0-9_]*)` \| ([^|]*) \|", section, re.M)


def test_every_setting_has_one_row_in_the_tables_order():
    rows = _settings_rows()
    assert [name for name, _ in rows] == list(settings.SETTINGS), WHAT_TO_DO


def test_each_row_lists_the_values_its_setting_takes():
    for name, values in _settings_rows():
        setting = settings.SETTINGS.get(name)
        assert setting is not None and values.strip() == setting.values, (name, WHAT_TO_DO)
