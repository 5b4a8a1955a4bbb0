"""Results name paths inside the repository relatively, and anything else as given."""
from __future__ import annotations

from testbed.paths import REPO, shown_path


def test_a_checkpoint_inside_the_repository_is_recorded_by_its_relative_path(tmp_path):
    assert shown_path(REPO / "build" / "checkpoints" / "tiny") == "build/checkpoints/tiny"
    assert shown_path(tmp_path / "ckpt") == str(tmp_path / "ckpt")  # outside: as given


def test_a_result_records_the_commit_it_was_made_on_and_whether_tracked_files_differed(tmp_path):
    """run_to_folder writes code_version() into summary.json: a committed reference run then says
    which code made it. Outside a git checkout there is nothing to say."""
    import subprocess

    from testbed.paths import code_version

    assert code_version(tmp_path) is None
    git = ["git", "-C", str(tmp_path), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    (tmp_path / "model.py").write_text("x = 1\n")
    subprocess.run([*git, "add", "model.py"], check=True)
    subprocess.run([*git, "commit", "-qm", "one"], check=True)
    head = subprocess.run([*git, "rev-parse", "HEAD"], check=True, capture_output=True, text=True).stdout.strip()
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "notes.txt").write_text("untracked files do not count\n")
    assert code_version(tmp_path) == {"commit": head, "dirty": False}
    (tmp_path / "model.py").write_text("x = 2\n")
    assert code_version(tmp_path) == {"commit": head, "dirty": True}
