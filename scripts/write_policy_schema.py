"""Regenerate ``policies/schema.json`` from the models: ``python scripts/write_policy_schema.py``.

``tests/unit/test_policies_schema.py`` fails when the file is stale.
"""

from __future__ import annotations

import json
from pathlib import Path

from colocd.policies import policy_json_schema

if __name__ == "__main__":
    path = Path(__file__).resolve().parents[1] / "policies" / "schema.json"
    path.write_text(json.dumps(policy_json_schema(), indent=2, sort_keys=True) + "\n")
    print(f"wrote {path}")
