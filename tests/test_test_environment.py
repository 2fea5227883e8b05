"""The test environment is reproducible: one install script that CI and the README both run, every test tool pinned."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_test_tool_is_pinned_to_one_version():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    unpinned = [req for req in extras["test"] if not re.match(r"^[A-Za-z0-9_.-]+==[0-9][^;\s]*(\s*;.*)?$", req)]
    assert not unpinned, f"test tools without an exact pin: {unpinned}"
    names = {re.split(r"[=;]", req)[0].strip().lower() for req in extras["test"]}
    assert {"hypothesis", "hypothesis-jsonschema", "pytest", "triton"} <= names


def test_ci_and_readme_install_through_the_same_script():
    script = "scripts/install_test_env.sh"
    assert (ROOT / script).stat().st_mode & 0o111, f"{script} is not executable"
    assert script in (ROOT / ".ci" / "run").read_text()
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("Run the whole test suite"):]
    assert re.search(r"git clone .*\n\s*cd |git clone .*&& cd ", setup)
    assert script in setup and "python -m pytest -q" in setup


def test_install_script_needs_no_sudo_as_root():
    text = (ROOT / "scripts" / "install_test_env.sh").read_text()
    lines = [line for line in text.splitlines() if line.strip().startswith("sudo")]
    assert not lines, f"unconditional sudo: {lines}"
    assert 'id -u' in text


def requirement_name(requirement: str) -> str:
    return re.split(r"[=<>!~;\[ ]", requirement, maxsplit=1)[0].strip().lower()


def readme_pdserve_installs() -> list[set[str]]:
    """The extras of pdserve that each `pip install -e .` of the README's set-up names (one set per install)."""
    readme = (ROOT / "README.md").read_text()
    setup = readme[readme.index("## Set up"):readme.index("Run the whole test suite")]
    found = [set(filter(None, (extras or "").split(","))) for extras in
             re.findall(r"pip install -e \"?\.(?:\[([a-z0-9,-]*)\])?\"?(?=\s)", setup)]
    assert len(found) >= 2, "the README's CPU and GPU install lines"
    return found


def test_the_readmes_install_brings_structured_output_as_ci_does():
    """xgrammar comes with every install the README names, and CI (the `test` extra) gets it the same way."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    for chosen in readme_pdserve_installs():
        installed = {requirement_name(r) for r in project["dependencies"]}
        installed |= {requirement_name(r) for extra in chosen for r in extras[extra]}
        assert "xgrammar" in installed, f"pip install -e '.[{','.join(sorted(chosen))}]' brings no xgrammar"
    assert "xgrammar" not in {requirement_name(r) for r in extras["test"]}, "CI would test what the README lacks"
    assert '-e ".[test]"' in (ROOT / "scripts" / "install_test_env.sh").read_text()
