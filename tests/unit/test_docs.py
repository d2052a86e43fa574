"""The documentation site: its generated pages match the code, and it builds with --strict
(a broken link or anchor, or a page missing from the nav, fails)."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
GENERATOR = ROOT / "docs" / "gen_reference.py"
GENERATED = ["reference/cli.md", "reference/http.md"]


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> Path:
    """The pages as the generator writes them now, from this checkout's code (a fresh interpreter:
    the generator puts the checkout's platform/ first on the import path)."""
    out = tmp_path_factory.mktemp("docs")
    subprocess.run([sys.executable, str(GENERATOR), "--out", str(out)], cwd=ROOT, check=True,
                   capture_output=True, text=True, timeout=120)
    return out


@pytest.mark.parametrize("page", GENERATED)
def test_generated_page_is_up_to_date(generated, page):
    committed = (ROOT / "docs" / page).read_text()
    assert committed == (generated / page).read_text(), "regenerate with: python docs/gen_reference.py"


def test_site_builds_strict(tmp_path):
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                           cwd=ROOT, capture_output=True, text=True, timeout=120, env=env)
    assert build.returncode == 0, f"mkdocs build --strict failed:\n{build.stdout}\n{build.stderr}"
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").exists()


def test_readme_is_short_and_its_links_into_docs_resolve():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.encode()) <= 15_000, "README.md is at most 15 KB: move the detail into docs/"
    for target in re.findall(r"\]\((docs/[^)#]+)", readme):
        assert (ROOT / target).exists(), f"README links to {target}, which does not exist"
