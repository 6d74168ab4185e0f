"""Hit rates of vLLM's own policy and the plugin's on every bundled workload, for one vLLM.

    .venv/bin/python bench/per_version_replay.py [--python PY] [--vllm-path DIR]
        [--pythonpath DIR] [--how TEXT] [--workloads agentic,chat] [--json]

Runs ``PY -m vllm_hybrid_backends.cli replay --workload W --json`` once per bundled workload
(:data:`vllm_hybrid_backends.replay.workloads.WORKLOADS`), each in its own process, and prints
one block of markdown table rows for docs/results.md "Per vLLM version": vLLM version, how it
ran, workload, upstream and plugin token hit rate, prefill tokens computed, state mismatches.
``--json`` prints the same rows as JSON instead.

``PY`` is the interpreter whose vLLM is measured (default: this one), e.g.
``.venv-matrix/0.23.0/bin/python``.  ``--vllm-path`` replays against a tree of vLLM sources
instead (``VLLM_HYBRID_VLLM_PATH``, e.g. ``.venv-vllm033/site``); ``--pythonpath`` adds a
directory of pure imports that tree needs (``PYTHONPATH``, e.g. ``.venv-matrix/extra``).
Exit status: 0 when every workload replayed with 0 state mismatches, else 1 (the rows of the
workloads that did replay are printed either way).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from vllm_hybrid_backends.replay.workloads import WORKLOADS

COLUMNS = ("vLLM", "how", "workload", "upstream hit", "plugin hit",
           "prefill tokens computed (upstream -> plugin)", "state mismatches")


def replay_env(vllm_path: str | None, pythonpath: str | None) -> dict[str, str]:
    """The environment of one replay process: ours, plus the source tree and extra imports."""
    env = dict(os.environ)
    for key, value in (("VLLM_HYBRID_VLLM_PATH", vllm_path), ("PYTHONPATH", pythonpath)):
        if value:
            env[key] = str(Path(value).resolve())
    return env


def replay_workload(python: str, workload: str, env: dict[str, str]) -> dict[str, Any]:
    """One ``replay --workload W --json`` run: its report, or ``{"error": ...}``."""
    command = [python, "-m", "vllm_hybrid_backends.cli", "replay", "--workload", workload, "--json"]
    start = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - start
    # exit status 1 is a report with state mismatches: still a report, the row shows them
    if proc.returncode not in (0, 1):
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"workload": workload, "error": f"exit status {proc.returncode}: {tail}"}
    report: dict[str, Any] = json.loads(proc.stdout)
    report["wall_s"] = round(wall, 1)
    return report


def table_row(report: dict[str, Any], how: str) -> dict[str, Any]:
    """The numbers of one workload's report that the per-version table shows."""
    upstream, plugin = report["policies"]["upstream"], report["policies"]["plugin"]
    return {
        "vllm": report["vllm_version"],
        "how": how,
        "workload": report["workload"],
        "upstream_hit": upstream["token_hit_rate"],
        "plugin_hit": plugin["token_hit_rate"],
        "prefill_tokens_upstream": upstream["prefill_tokens_computed"],
        "prefill_tokens_plugin": plugin["prefill_tokens_computed"],
        "state_mismatches_upstream": upstream["state_mismatches"],
        "state_mismatches_plugin": plugin["state_mismatches"],
        "wall_s": report["wall_s"],
    }


def markdown_row(row: dict[str, Any]) -> str:
    cells = [row["vllm"], row["how"], row["workload"], f"{row['upstream_hit']:.3f}",
             f"{row['plugin_hit']:.3f}",
             f"{row['prefill_tokens_upstream']:,} -> {row['prefill_tokens_plugin']:,}",
             f"{row['state_mismatches_upstream']} / {row['state_mismatches_plugin']}"]
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--python", default=sys.executable,
                        help="the interpreter whose vLLM is measured (default: this one)")
    parser.add_argument("--vllm-path", help="a tree of vLLM sources (VLLM_HYBRID_VLLM_PATH)")
    parser.add_argument("--pythonpath", help="extra imports for that tree (PYTHONPATH)")
    parser.add_argument("--how", default="", help="the table's 'how' cell (default: the interpreter)")
    parser.add_argument("--workloads", default=",".join(WORKLOADS),
                        help=f"comma-separated (default: every bundled one: {', '.join(WORKLOADS)})")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = parser.parse_args(argv)
    workloads = [w for w in args.workloads.split(",") if w]
    unknown = [w for w in workloads if w not in WORKLOADS]
    if unknown or not workloads:
        parser.error(f"--workloads: unknown {unknown or args.workloads!r}; allowed: {', '.join(WORKLOADS)}")
    how = args.how or f"`{args.python}`" + (f" on `{args.vllm_path}`" if args.vllm_path else "")
    env = replay_env(args.vllm_path, args.pythonpath)

    rows, errors = [], []
    for workload in workloads:
        print(f"replay {workload} ...", file=sys.stderr, flush=True)
        report = replay_workload(args.python, workload, env)
        if "error" in report:
            errors.append(report)
            print(f"  {workload}: {report['error']}", file=sys.stderr)
            continue
        rows.append(table_row(report, how))
        print(f"  {markdown_row(rows[-1])} ({rows[-1]['wall_s']} s)", file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps({"rows": rows, "errors": errors}, indent=2))
    else:
        print("| " + " | ".join(COLUMNS) + " |")
        print("|" + " --- |" * len(COLUMNS))
        for row in rows:
            print(markdown_row(row))
    mismatched = any(r["state_mismatches_upstream"] or r["state_mismatches_plugin"] for r in rows)
    return 1 if errors or mismatched else 0


if __name__ == "__main__":
    sys.exit(main())
