"""The federation checkpoint's file: plain data only, atomic writes, clear errors, never running code."""

from __future__ import annotations

import os
import pathlib
import stat
import zipfile
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from _helpers import assert_nested_same

from lightning_dfl.federation.trainer.checkpoint_file import (
    FORMAT,
    FORMAT_VERSION,
    SAFE_TO_CHANGE,
    CheckpointError,
    check_file,
    compare_identity,
    read_state,
    write_state,
)


def _state() -> dict:
    return {"next_round": 3, "identity": {"seed": 0, "lr": 0.05},
            "store": {"weights": OrderedDict(w=torch.arange(6.0).reshape(2, 3)), "slot": torch.tensor([0, 1]),
                      "extras": [{}, {"k": None}]},
            "history": [{"acc": 0.5, "ok": True}], "callbacks": {"Voting{}": {"votes": {0: 1}, "pair": (1, "a")}}}


def _assert_same(a, b) -> None:
    assert_nested_same(a, b, lambda x, y: torch.equal(x, y) or pytest.fail(f"{x} != {y}"), same_types=True)


# -- writing -----------------------------------------------------------------------------
def test_round_trip_keeps_tensors_containers_and_types(tmp_path):
    path = write_state(tmp_path / "sub" / "last.ckpt", _state())
    assert path == tmp_path / "sub" / "last.ckpt" and not (tmp_path / "sub" / "last.ckpt.tmp").exists()
    _assert_same(read_state(path), _state())
    raw = torch.load(path, weights_only=True)
    assert raw["format"] == FORMAT == "lightning-dfl/federation" and raw["format_version"] == FORMAT_VERSION == 2


@dataclass
class PruneEvent:
    round_idx: int


@pytest.mark.parametrize(("value", "where", "what"), [
    ({"callbacks": {"RigL": {"history": [0, 1, 2, PruneEvent(3)]}}},
     r"state\['callbacks'\]\['RigL'\]\['history'\]\[3\]: PruneEvent is not a tensor or plain container", ""),
    ({"history": [{"acc": np.float64(0.5)}]}, r"state\['history'\]\[0\]\['acc'\]: float64 ", "numpy values"),
    ({"n": np.int64(1)}, r"state\['n'\]: int64 ", "numpy values"),
    ({"a": np.zeros(2)}, r"state\['a'\]: ndarray ", "numpy values"),
    ({"s": {1, 2}}, r"state\['s'\]: set is not", ""),
    ({"d": {(0, 1): 2}}, r"state\['d'\]: key \(0, 1\) is a tuple", ""),
])
def test_write_refuses_non_plain_values_naming_their_key_path(tmp_path, value, where, what):
    with pytest.raises(TypeError, match=where) as err:
        write_state(tmp_path / "x.ckpt", value)
    assert what in str(err.value)
    assert not list(tmp_path.iterdir())  # refused before anything is written


def test_write_refuses_the_marker_keys(tmp_path):
    with pytest.raises(ValueError, match="reserved"):
        write_state(tmp_path / "x.ckpt", {"format_version": 3})


def test_a_failing_write_leaves_the_previous_file_intact_and_no_tmp(tmp_path, monkeypatch):
    """Decision: a failed write removes ``<path>.tmp``; ``path`` keeps the previous checkpoint."""
    path = write_state(tmp_path / "last.ckpt", {"next_round": 1})
    before = path.read_bytes()

    def half_then_fail(obj, file):
        file.write(b"PK\x03\x04 half of a checkpoint")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", half_then_fail)
    with pytest.raises(CheckpointError, match="cannot write the checkpoint .*last.ckpt': disk full; the previous"):
        write_state(path, {"next_round": 2})
    assert path.read_bytes() == before and read_state(path) == {"next_round": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt"]


@pytest.mark.skipif(os.name != "posix", reason="folders are synced where the OS can open them")
def test_the_file_is_synced_before_it_replaces_the_target_and_the_folder_after(tmp_path, monkeypatch):
    events = []
    fsync, replace = os.fsync, os.replace

    def record_fsync(fd):
        events.append("fsync folder" if stat.S_ISDIR(os.fstat(fd).st_mode) else "fsync file")
        fsync(fd)

    def record_replace(src, dst):
        events.append("replace")
        replace(src, dst)

    monkeypatch.setattr(os, "fsync", record_fsync)
    monkeypatch.setattr(os, "replace", record_replace)
    write_state(tmp_path / "last.ckpt", {"next_round": 1})
    assert events == ["fsync file", "replace", "fsync folder"]


# -- reading damaged and foreign files ---------------------------------------------------
def _good(tmp_path) -> pathlib.Path:
    return write_state(tmp_path / "good.ckpt", {"weights": torch.ones(300), "next_round": 1})


def _damaged(tmp_path, case: str) -> pathlib.Path:
    path = tmp_path / f"{case}.ckpt"
    if case == "empty":
        path.touch()
    elif case == "truncated":
        data = _good(tmp_path).read_bytes()
        path.write_bytes(data[: len(data) // 2])
    elif case == "random":
        path.write_bytes(np.random.default_rng(0).bytes(2000))
    elif case == "foreign":
        torch.save({"a": 1}, path)
    elif case == "lightning":
        torch.save({"epoch": 3, "global_step": 30, "pytorch-lightning_version": "2.6.0",
                    "state_dict": {"w": torch.ones(2)}, "optimizer_states": [], "lr_schedulers": []}, path)
    elif case == "tensor":
        torch.save(torch.zeros(2, 3), path)
    elif case == "folder":
        path.mkdir()
    return path


@pytest.mark.parametrize(("case", "message"), [
    ("missing", "no checkpoint at .*: the path does not exist"),
    ("folder", "no checkpoint at .*: it is a folder"),
    ("empty", "is empty"),
    ("truncated", "is truncated or damaged"),
    ("random", "is not a checkpoint: it is not a torch zip archive"),
    ("foreign", r"is not a lightning-dfl federation checkpoint: it seems to hold a dict with keys \['a'\]"),
    ("lightning", "is not a lightning-dfl federation checkpoint: it seems to hold a Lightning Trainer checkpoint "
                  r"\(pytorch-lightning_version 2.6.0"),
    ("tensor", r"is not a lightning-dfl federation checkpoint: it seems to hold a tensor of shape \(2, 3\)"),
])
def test_damaged_or_foreign_files_give_one_clear_error_naming_the_path(tmp_path, case, message):
    path = _damaged(tmp_path, case)
    with pytest.raises(CheckpointError, match=message) as err:
        read_state(path)
    assert isinstance(err.value, ValueError) and repr(str(path)) in str(err.value)


@pytest.mark.parametrize("part", ["data.pkl", "data/0"])
def test_a_flipped_byte_fails_the_checksum_which_torch_does_not_check(tmp_path, part):
    path = _good(tmp_path)
    with zipfile.ZipFile(path) as archive:
        name = next(n for n in archive.namelist() if n.endswith("/" + part))
        raw = archive.read(name)
    data = bytearray(path.read_bytes())
    at = data.find(raw[:16]) + 8
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"is damaged: its part '{name}' fails its checksum"):
        read_state(path)


def _rezip(tmp_path, members: dict) -> pathlib.Path:
    path = tmp_path / "rezipped.ckpt"
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    return path


def test_damaged_pickled_data_with_a_valid_checksum_is_refused(tmp_path):
    with zipfile.ZipFile(_good(tmp_path)) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    members[next(n for n in members if n.endswith("/data.pkl"))] = b"\x80\x02\xff\xff."
    with pytest.raises(CheckpointError, match="is damaged: its pickled data cannot be read weights-only"):
        read_state(_rezip(tmp_path, members))


def test_a_zip_that_is_not_a_torch_file_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="is damaged or not a torch checkpoint"):
        read_state(_rezip(tmp_path, {"hello.txt": "hi"}))


@pytest.mark.parametrize(("version", "age"), [(3, "a newer"), (1, "an older")])
def test_another_format_version_is_refused(tmp_path, version, age):
    path = tmp_path / "v.ckpt"
    torch.save({"format": FORMAT, "format_version": version, "next_round": 1}, path)
    with pytest.raises(CheckpointError, match=f"format_version {version}, written by {age} lightning-dfl; "
                                              "this one reads format_version 2 only"):
        read_state(path)


def test_a_format_1_file_without_marker_is_named_an_older_version(tmp_path):
    path = tmp_path / "v1.ckpt"
    torch.save({"format_version": 1, "next_round": 1, "identity": {}, "store": {}}, path)
    with pytest.raises(CheckpointError, match="format_version 1, written by an older"):
        read_state(path)


class _Touch:
    """Unpickling this would create ``marker``."""

    def __init__(self, marker: pathlib.Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return pathlib.Path.touch, (self.marker,)


def test_a_pickled_object_is_refused_and_never_run(tmp_path):
    marker = tmp_path / "was-executed"
    path = tmp_path / "evil.ckpt"
    torch.save({"format": FORMAT, "format_version": FORMAT_VERSION, "payload": _Touch(marker)}, path)
    with pytest.raises(CheckpointError, match="holds a refused pickled object .*it is not loaded") as err:
        read_state(path)
    assert repr(str(path)) in str(err.value)
    assert not marker.exists()


def test_a_foreign_numpy_value_is_refused_as_a_pickled_object(tmp_path):
    path = tmp_path / "np.ckpt"
    torch.save({"x": np.float64(1.0)}, path)
    with pytest.raises(CheckpointError, match=r"holds a refused pickled object \(numpy"):
        read_state(path)


def test_map_location_is_passed_on(tmp_path):
    state = read_state(_good(tmp_path), map_location=torch.device("meta"))
    assert state["weights"].device.type == "meta"


# -- identity ----------------------------------------------------------------------------
_SAVED = {"algorithm": "DADPFL()", "seed": 0, "rounds": 10, "lr": 0.05, "density": 0.5, "partition": "dir",
          "alpha": 0.3}


def test_an_equal_identity_passes_with_nothing_to_log():
    assert compare_identity(_SAVED, dict(_SAVED)) == []


def test_safe_keys_may_always_change_and_are_returned():
    assert {"rounds", "eval_every", "checkpoint_every"} <= SAFE_TO_CHANGE
    assert compare_identity(_SAVED, {**_SAVED, "rounds": 20}) == ["rounds"]


def test_disallowed_changes_are_all_named_with_both_values_and_how_to_allow_them():
    now = {**_SAVED, "lr": 0.1, "alpha": 0.5, "rounds": 20}
    with pytest.raises(ValueError, match="another configuration") as err:
        compare_identity(_SAVED, now)
    text = str(err.value)
    assert "lr: checkpoint=0.05 now=0.1" in text and "alpha: checkpoint=0.3 now=0.5" in text
    assert "rounds" not in text.split("\n", 1)[1].split("to resume")[0]  # safe: not refused
    # the command line's option (the Python keyword alone read as a CLI hint), and the Python argument
    assert "--trainer.resume_allow '[alpha,lr]'" in text and "FederatedTrainer(resume_allow=['alpha', 'lr'])" in text


def test_allowed_changes_pass_and_are_returned_with_the_safe_ones():
    now = {**_SAVED, "lr": 0.1, "alpha": 0.5, "rounds": 20}
    assert compare_identity(_SAVED, now, allow=["lr", "alpha"]) == ["alpha", "lr", "rounds"]
    with pytest.raises(ValueError, match=r"alpha: checkpoint=0.3 now=0.5") as err:
        compare_identity(_SAVED, now, allow=["lr"])
    assert "lr:" not in str(err.value)


def test_a_key_on_one_side_only_is_a_difference():
    with pytest.raises(ValueError, match=r"momentum: checkpoint=<absent> now=0.9"):
        compare_identity(_SAVED, {**_SAVED, "momentum": 0.9})
    assert compare_identity(_SAVED, {**_SAVED, "momentum": 0.9}, allow=("momentum",)) == ["momentum"]


def test_unknown_allow_keys_are_refused_listing_the_valid_ones():
    with pytest.raises(ValueError, match=r"cannot allow \['learning_rate'\]: not identity keys; the identity keys "
                                         r"are \['algorithm', 'alpha', 'density', 'lr', 'partition', 'rounds'"):
        compare_identity(_SAVED, dict(_SAVED), allow=["learning_rate", "lr"])


def test_a_full_disk_or_a_read_only_folder_is_one_line_naming_the_path_and_the_cause(tmp_path, monkeypatch):
    import errno

    path = write_state(tmp_path / "last.ckpt", {"next_round": 1})

    def full(obj, file):
        file.write(b"PK\x03\x04 half")
        raise RuntimeError("[enforce fail at inline_container.cc:783] . unexpected pos 64 vs 0") from OSError(
            errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(CheckpointError) as info:
        write_state(path, {"next_round": 2})
    message = str(info.value)
    assert "\n" not in message and repr(str(path)) in message
    assert "No space left on device (ENOSPC)" in message and "the previous checkpoint is kept" in message
    assert read_state(path) == {"next_round": 1}
    monkeypatch.undo()
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        if os.access(folder, os.W_OK):
            pytest.skip("running as a user who may write anywhere (root)")
        with pytest.raises(CheckpointError, match="cannot write the checkpoint .*: Permission denied .EACCES."):
            write_state(folder / "last.ckpt", {"next_round": 1})
    finally:
        folder.chmod(0o700)


def test_a_refused_pickled_object_is_never_called_damaged_nor_told_to_turn_the_check_off(tmp_path):
    with zipfile.ZipFile(_good(tmp_path)) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    members[next(n for n in members if n.endswith("/data.pkl"))] = b"\x80\x02}q\x00}b."  # BUILD on a dict
    with pytest.raises(CheckpointError, match="holds a refused pickled object") as info:
        read_state(_rezip(tmp_path, members))
    message = str(info.value).replace(str(tmp_path), "")
    assert "damaged" not in message and "weights_only" not in message and "safe_globals" not in message


# -- a small file that declares a huge tensor ----------------------------------------------------
@pytest.fixture(scope="module")
def bomb(tmp_path_factory) -> pathlib.Path:
    """A 0.5 MB checkpoint whose tensor part is 512 MiB of zeros, deflated (a "zip bomb")."""
    folder = tmp_path_factory.mktemp("bomb")
    with zipfile.ZipFile(write_state(folder / "small.ckpt", {"w": torch.zeros(4), "next_round": 1})) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    path = folder / "bomb.ckpt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for name, data in members.items():
            if name.endswith("/data/0"):
                with archive.open(name, "w", force_zip64=True) as part:
                    for _ in range(512):
                        part.write(bytes(2**20))
            else:
                archive.writestr(name, data)
    assert path.stat().st_size < 2**20
    return path


class _Loaded(Exception):
    """torch.load was called."""


def test_a_compressed_huge_tensor_is_refused_from_the_zip_directory_alone(bomb, monkeypatch):
    def load(*args, **kwargs):
        raise _Loaded

    monkeypatch.setattr(torch, "load", load)
    monkeypatch.setattr(zipfile.ZipFile, "testzip", lambda self: pytest.fail("a part's data was read"))
    with pytest.raises(CheckpointError, match=r"declares 512.0 MiB of data in a file of 5\d\d.\d KiB: refused "
                                              "before reading it") as err:
        read_state(bomb)
    assert repr(str(bomb)) in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(CheckpointError, match="declares 512.0 MiB"):  # also the cheap check before a run starts
        check_file(bomb)


def test_a_checkpoint_larger_than_the_available_memory_is_refused(tmp_path, monkeypatch):
    from lightning_dfl.federation.trainer import checkpoint_file as checkpoint_io

    path = _good(tmp_path)
    monkeypatch.setattr(checkpoint_io, "_available_memory", lambda: 1000)
    with pytest.raises(CheckpointError, match=r"declares 1.\d KiB of data, more than the 1000 B of memory available"):
        read_state(path)
    monkeypatch.setattr(checkpoint_io, "_available_memory", lambda: None)
    assert read_state(path)["next_round"] == 1


def test_a_compressed_but_modest_checkpoint_is_still_read(tmp_path):
    with zipfile.ZipFile(_good(tmp_path)) as archive:
        members = {n: archive.read(n) for n in archive.namelist()}
    path = tmp_path / "deflated.ckpt"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
    assert torch.equal(read_state(path)["weights"], torch.ones(300))


def test_every_memory_message_writes_a_size_one_way():
    """``format_bytes``: bytes below 1 KiB, KiB and MiB to a tenth, GiB to a hundredth (the checkpoint, store and
    data-set checks all use it)."""
    from lightning_dfl.host_memory import format_bytes

    assert [format_bytes(n) for n in (0, 1023, 1024, 5400, 512 * 2**20, 11.44 * 2**30, 3 * 2**40)] == [
        "0 B", "1023 B", "1.0 KiB", "5.3 KiB", "512.0 MiB", "11.44 GiB", "3072.00 GiB"]


class _Strided:
    """Pickles as a tensor over a 4-element storage with the given size, stride and offset (what a crafted file
    can declare; torch's own tensors cannot be saved that way)."""

    def __init__(self, size, stride, offset=0):
        self.args = (tuple(size), tuple(stride), offset)

    def __reduce_ex__(self, protocol):
        size, stride, offset = self.args
        return (torch._utils._rebuild_tensor_v2,
                (torch.zeros(4)._typed_storage(), offset, size, stride, False, OrderedDict()))


@pytest.mark.parametrize("where", ["algorithm", "callbacks", "history"])
@pytest.mark.parametrize("tensor", [_Strided((10**6, 10**6), (0, 0)), torch.zeros(1).expand(10**5, 10**5),
                                    _Strided((10**9,), (0,))], ids=["stride_0", "expanded", "one_dim"])
def test_a_stride_bomb_is_refused_on_load(tmp_path, where, tensor):
    """A few stored bytes declared as terabytes (zero strides): refused before any check touches its values."""
    path = tmp_path / "bomb.ckpt"
    part = {"algorithm": {"state": {"x": tensor}}, "callbacks": {"RigL": {"x": tensor}},
            "history": [{"x": tensor}]}[where]
    torch.save({"format": FORMAT, "format_version": 2, "next_round": 1, where: part}, path)
    with pytest.raises(CheckpointError, match=r"holds a tensor \[.*elements in a storage of"):
        read_state(path)


def test_a_deeply_nested_checkpoint_is_refused_without_recursion(tmp_path):
    import sys

    nested: list = []
    inner = nested
    for _ in range(3000):
        inner.append([])
        inner = inner[0]
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(20000)
    try:
        torch.save({"format": FORMAT, "format_version": 2, "next_round": 1, "history": nested}, tmp_path / "deep.ckpt")
    finally:
        sys.setrecursionlimit(limit)
    with pytest.raises(CheckpointError, match="nests containers more than 64 deep"):
        read_state(tmp_path / "deep.ckpt")


def test_every_tensor_of_a_real_checkpoint_fits_its_storage(tmp_path):
    base = torch.arange(12.0)
    state = {"view": base[2:8:2], "t": base.view(3, 4).t(), "empty": torch.zeros(0, 5), "scalar": torch.tensor(3.0)}
    write_state(tmp_path / "ok.ckpt", state)
    loaded = read_state(tmp_path / "ok.ckpt")
    assert all(torch.equal(loaded[k], v) for k, v in state.items())
