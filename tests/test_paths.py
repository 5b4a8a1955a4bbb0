"""Results name paths inside the repository relatively, and anything else as given."""
from __future__ import annotations

from testbed.paths import REPO, shown_path


def test_a_checkpoint_inside_the_repository_is_recorded_by_its_relative_path(tmp_path):
    assert shown_path(REPO / "build" / "checkpoints" / "tiny") == "build/checkpoints/tiny"
    assert shown_path(tmp_path / "ckpt") == str(tmp_path / "ckpt")  # outside: as given
