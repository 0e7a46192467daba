"""What a path is, and image folders walked without hanging: each real folder once, regular files only."""

import os

import pytest

from lightning_dfl.errors import ConfigurationError
from lightning_dfl.files import check_regular_file, path_kind, regular_files


def _tree(root):
    for rel in ("a/2.jpg", "a/10.JPG", "a/notes.txt", "a/sub/1.png", "a/sub/deeper/0.jpeg", "b/0.jpg"):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(b"x")
    return root


def test_the_kinds_of_path(tmp_path):
    _tree(tmp_path)
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "dangling").symlink_to(tmp_path / "absent")
    assert [path_kind(p) for p in (tmp_path / "b" / "0.jpg", tmp_path / "a", tmp_path / "pipe", "/dev/null",
                                   tmp_path / "dangling", tmp_path / "absent")] == [
        "a regular file", "a folder", "a FIFO (named pipe)", "a character device", "a broken link", "missing"]
    assert check_regular_file(tmp_path / "b" / "0.jpg", "image") == tmp_path / "b" / "0.jpg"
    with pytest.raises(ConfigurationError, match="config file '.*pipe' is a FIFO \\(named pipe\\), not a regular"):
        check_regular_file(tmp_path / "pipe", "config file")
    with pytest.raises(ConfigurationError, match="checkpoint '.*absent' does not exist"):
        check_regular_file(tmp_path / "absent", "checkpoint")


def test_a_plain_tree_is_listed_in_torchvisions_order(tmp_path):
    from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

    root = _tree(tmp_path)
    expected = [path for path, _ in make_dataset(str(root), {"a": 0}, extensions=IMG_EXTENSIONS)]
    assert regular_files(root / "a", IMG_EXTENSIONS) == expected
    assert [os.path.relpath(p, root) for p in expected] == ["a/10.JPG", "a/2.jpg", "a/sub/1.png",
                                                            "a/sub/deeper/0.jpeg"]


def test_link_loops_and_repeated_links_are_walked_once(tmp_path):
    root = _tree(tmp_path)
    (root / "a" / "loop1").symlink_to(root / "a")  # two links to the folder itself: os.walk(followlinks) never ends
    (root / "a" / "loop2").symlink_to(root / "a")
    (root / "a" / "sub" / "up").symlink_to(root / "a")
    (root / "a" / "other").symlink_to(root / "b")  # a link to a folder seen nowhere else is walked
    names = [os.path.relpath(p, root) for p in regular_files(root / "a", (".jpg", ".png", ".jpeg"))]
    assert names == ["a/10.JPG", "a/2.jpg", "a/other/0.jpg", "a/sub/1.png", "a/sub/deeper/0.jpeg"]


def test_an_image_name_that_is_not_a_regular_file_is_refused(tmp_path):
    root = _tree(tmp_path)
    os.mkfifo(root / "a" / "3.jpg")
    os.mkfifo(root / "a" / "pipe.txt")  # not an image name: not read, not refused
    with pytest.raises(ConfigurationError, match="3.jpg' is a FIFO \\(named pipe\\), not a regular file"):
        regular_files(root / "a", (".jpg",))


def test_of_two_links_to_one_folder_the_first_in_path_order_counts(tmp_path):
    root = _tree(tmp_path)
    (root / "a" / "y").symlink_to(root / "b")
    (root / "a" / "x").symlink_to(root / "b")
    names = [os.path.relpath(p, root) for p in regular_files(root / "a", (".jpg",))]
    assert names == ["a/10.JPG", "a/2.jpg", "a/x/0.jpg"]
