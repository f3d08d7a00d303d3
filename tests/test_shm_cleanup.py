"""conftest.remove_stale_mpich_segments: only old segments no live process maps are removed."""

import mmap
import os

from conftest import remove_stale_mpich_segments


def test_only_old_unmapped_segments_are_removed(tmp_path):
    old = os.path.getmtime(tmp_path) - 3600
    paths = {name: tmp_path / f"mpich_shm_{name}_0" for name in ("stale", "mapped", "new")}
    for name, path in paths.items():
        path.write_bytes(b"\0" * 4096)
        if name != "new":
            os.utime(path, (old, old))
    (tmp_path / "other_file").write_bytes(b"x")
    os.utime(tmp_path / "other_file", (old, old))
    with open(paths["mapped"], "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a job still using its segment
        removed = remove_stale_mpich_segments(tmp_path, min_age_s=60)
    assert removed == [paths["stale"]]
    assert not paths["stale"].exists() and paths["mapped"].exists() and paths["new"].exists()
    assert (tmp_path / "other_file").exists()
    assert remove_stale_mpich_segments(tmp_path, min_age_s=60) == [paths["mapped"]]  # unmapped now
