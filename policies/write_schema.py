"""Developer script: regenerate ``schema.json`` from the models: ``python -m colocd.policies.write_schema``.

Not imported by colocd; ``tests/unit/test_policies_schema.py`` fails when the file is stale.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from .document import policy_json_schema

__all__ = ["SCHEMA_PATH", "render_schema"]

SCHEMA_PATH = Path(__file__).with_name("schema.json")


def render_schema() -> str:
    """The exact text ``schema.json`` must hold."""
    return json.dumps(policy_json_schema(), indent=2, sort_keys=True) + "\n"


if __name__ == "__main__":
    SCHEMA_PATH.write_text(render_schema())
    sys.stdout.write(f"wrote {SCHEMA_PATH}\n")
