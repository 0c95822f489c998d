"""Merge the benchmarks' JSON parts into results.json and print the short table gpu-check ends
with. Usage: python scripts/gpu_check_summary.py OUT_DIR [LAST_PYTEST_LINE]"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    out = Path(sys.argv[1])
    tests_line = sys.argv[2] if len(sys.argv) > 2 else ""
    parts = {p.stem: json.loads(p.read_text()) for p in sorted((out / "parts").glob("*.json"))}
    (out / "results.json").write_text(json.dumps(parts, indent=1))
    print("\n================ gpu-check summary ================")
    if tests_line:
        print(f"GPU tests: {tests_line.strip()}")
    for name, data in parts.items():
        headline = data.get("summary") if isinstance(data, dict) else None
        if headline is None and isinstance(data, dict):
            headline = {k: v for k, v in data.items() if isinstance(v, (int, float))}
        print(f"{name}: {json.dumps(headline, default=str)[:600]}")


if __name__ == "__main__":
    main()
