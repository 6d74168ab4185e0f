"""Meta-tests: every hook is documented and tested; generated docs are current."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

from vllm_hybrid_backends import docs, hookspecs, patches

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("hook", docs.hook_names())
def test_hook_has_a_full_docstring(hook):
    doc = inspect.getdoc(getattr(hookspecs, hook)) or ""
    assert len(doc.splitlines()) >= 3, f"{hook} needs a docstring saying who calls it, when, and its parameters"


@pytest.mark.parametrize("hook", docs.hook_names())
def test_hook_is_exercised_by_a_test(hook):
    facade = hook.removeprefix("hb_")
    sources = [p.read_text() for p in (ROOT / "tests").rglob("test_*.py") if p.name != "test_docs.py"]
    assert any(hook in s or f".{facade}(" in s for s in sources), f"no test calls {hook} or its facade"


@pytest.mark.parametrize("page", sorted(docs.PAGES))
def test_generated_docs_are_current(page):
    current = (ROOT / "docs" / page).read_text(encoding="utf-8")
    assert current == docs.PAGES[page](), f"docs/{page} is stale: run python -m vllm_hybrid_backends.docs"


def test_every_hook_is_in_the_hooks_page():
    page = (ROOT / "docs" / "hooks.md").read_text(encoding="utf-8")
    for hook in docs.hook_names():
        assert f"## `{hook}`" in page


def test_every_patch_module_documents_why_how_upstream_versions():
    for module in patches.patch_modules():
        doc = (module.__doc__ or "").lower()
        for part in ("why:", "how:", "upstream:", "vllm versions:", "removal:"):
            assert part in doc, f"{module.__name__} docstring lacks {part!r}"
        assert module.__name__.rsplit(".", 1)[-1] == "patch_" + module.TARGET_MODULE.replace(".", "_")


def test_state_operation_hooks_are_all_specified():
    assert set(hookspecs.STATE_OPERATION_HOOKS) <= set(docs.hook_names())
