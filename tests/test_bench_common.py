"""benchmarks/common.py: what a result file says about the code it measured."""

from __future__ import annotations

import re
import subprocess

from benchmarks.common import git_revision


def _git(repo, *args: str) -> str:
    return subprocess.check_output(["git", *args], cwd=repo, text=True).strip()


def test_git_revision_names_head_and_says_when_tracked_files_differ(tmp_path):
    _git(tmp_path, "init", "-q")
    (tmp_path / "kernel.py").write_text("x = 1\n")
    _git(tmp_path, "add", "kernel.py")
    _git(tmp_path, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "one")
    head = _git(tmp_path, "rev-parse", "--short", "HEAD")
    assert re.fullmatch(r"[0-9a-f]{7,}", head) and git_revision(tmp_path) == head
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert git_revision(tmp_path) == head
    (tmp_path / "kernel.py").write_text("x = 2\n")
    assert git_revision(tmp_path) == head + "-dirty"


def test_git_revision_outside_a_repository_is_unknown(tmp_path):
    assert git_revision(tmp_path) == "unknown"
