import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DATA = Path(__file__).resolve().parent / "data"


@pytest.fixture
def v41_raw():
    """The shipped V4.1-Flash config as a plain dict, to break one field at a time."""
    return json.loads((ROOT / "configs" / "v41_flash.json").read_text())


@pytest.fixture
def write_config(tmp_path):
    """Writes a dict as a .json config file and returns its path."""

    def write(raw, name="cfg.json"):
        path = tmp_path / name
        path.write_text(json.dumps(raw))
        return path

    return write
