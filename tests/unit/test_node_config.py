"""The node config file: keys older files may still carry."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from colocd.daemon.config import ListenConfig, load_node_config


def test_a_config_naming_the_removed_chunk_channel_loads_and_warns_naming_the_key(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "node.yaml"
    path.write_text("listen:\n  port: 7000\n  chunk_channel: /run/colocd.chunks\n")
    with caplog.at_level(logging.WARNING, logger="colocd.config"):
        config = load_node_config(path)
    assert config.listen == ListenConfig(port=7000)
    assert "listen.chunk_channel is ignored" in caplog.text and "HTTP" in caplog.text
