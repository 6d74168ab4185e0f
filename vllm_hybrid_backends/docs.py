"""Generated reference pages: ``docs/hooks.md`` (from the hook specifications) and
``docs/patches.md`` (from the patch modules). ``python -m vllm_hybrid_backends.docs`` rewrites
them; ``tests/test_docs.py`` fails when they are stale."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from . import hookspecs, patches


def hook_names() -> list[str]:
    return [name for name, _ in inspect.getmembers(hookspecs, inspect.isfunction)
            if name.startswith("hb_")]


def render_hooks() -> str:
    source_order = sorted(hook_names(), key=lambda n: inspect.getsourcelines(getattr(hookspecs, n))[1])
    lines = ["# Backend hooks", "",
             "Generated from `vllm_hybrid_backends/hookspecs.py` by "
             "`python -m vllm_hybrid_backends.docs`; do not edit by hand.", "",
             inspect.cleandoc(hookspecs.__doc__ or ""), ""]
    for name in source_order:
        fn = getattr(hookspecs, name)
        opts = getattr(fn, f"{hookspecs.PROJECT_NAME}_spec", {}) or {}
        flags = " (firstresult)" if opts.get("firstresult") else ""
        signature = str(inspect.signature(fn)).replace("'", "")
        lines += [f"## `{name}`{flags}", "", "```python", f"def {name}{signature}", "```", "",
                  inspect.cleandoc(fn.__doc__ or ""), ""]
    return "\n".join(lines)


PAGES = {"hooks.md": render_hooks, "patches.md": patches.render_index}


def write(docs_dir: Path) -> None:
    for filename, render in PAGES.items():
        (docs_dir / filename).write_text(render(), encoding="utf-8")


if __name__ == "__main__":
    write(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "docs")
