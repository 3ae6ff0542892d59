"""The node config file: a key colocd does not read is refused, naming it."""

from __future__ import annotations

from pathlib import Path

import pytest

from colocd.daemon.config import load_node_config
from colocd.errors import ConfigError


def test_a_config_naming_a_key_colocd_does_not_read_is_refused_naming_the_key(tmp_path: Path) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("listen:\n  port: 7000\n  chunk_channel: /run/colocd.chunks\n")
    with pytest.raises(ConfigError, match=r"listen\.chunk_channel"):
        load_node_config(path)
