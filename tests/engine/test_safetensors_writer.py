"""The parallel safetensors writer writes what ``safetensors.torch.save_file`` writes, byte for byte, and
``save_pruned`` writes its shards with it."""

from __future__ import annotations

import errno
import json
import os
import stat
import struct
import threading
import time

import pytest
import torch
import transformers.modeling_utils as modeling_utils
from safetensors.torch import load_file, save_file

import ompmoe
from ompmoe.engine.export import safetensors_writer
from ompmoe.engine.export.safetensors_writer import (SAFETENSORS_DTYPES, parallel_pretrained_writes,
                                                     write_safetensors)
from ompmoe.engine.tiny import tiny_model


def every_kind_of_tensor() -> dict[str, torch.Tensor]:
    """One tensor of each dtype written here, and the shapes and names that test the layout: a scalar, an empty
    tensor, a transposed (non-contiguous) one, one larger than a piece, a non-ASCII name, names out of order."""
    generator = torch.Generator().manual_seed(0)
    tensors = {}
    for position, dtype in enumerate(SAFETENSORS_DTYPES):
        values = torch.randint(0, 120, (5, 7), generator=generator)
        tensors[f"z{position:02d}.{str(dtype)[6:]}"] = values > 60 if dtype == torch.bool else values.to(dtype)
    tensors["scalar"] = torch.tensor(3.5)
    tensors["empty"] = torch.zeros(0, 4, dtype=torch.bfloat16)
    tensors["transposed"] = torch.randn(20, 30, generator=generator).t()
    tensors["large"] = torch.randn(400, 333, generator=generator).to(torch.bfloat16)
    tensors["a.gewichtsmatrix.ü"] = torch.randn(3, generator=generator)
    return tensors


def stock_bytes(tensors: dict[str, torch.Tensor], path, metadata) -> bytes:
    save_file({name: tensor.contiguous() for name, tensor in tensors.items()}, str(path), metadata=metadata)
    return path.read_bytes()


@pytest.mark.parametrize("staged", [False, True], ids=["from_memory", "through_buffers"])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("metadata", [{"format": "pt"}, None], ids=["format_pt", "no_metadata"])
def test_the_file_is_byte_for_byte_what_save_file_writes(tmp_path, monkeypatch, staged, threads, metadata):
    """Pieces of 100 bytes and buffers of 1000 cut the large tensors across threads and runs; ``staged`` sends
    every piece through the host buffers, as an accelerator's tensors go."""
    monkeypatch.setattr(safetensors_writer, "PIECE_BYTES", 100)
    monkeypatch.setattr(safetensors_writer, "STAGING_BYTES", 1000)
    if staged:
        monkeypatch.setattr(safetensors_writer, "needs_staging", lambda tensor: True)
    tensors = every_kind_of_tensor()
    write_safetensors(tensors, tmp_path / "ours.safetensors", metadata, threads=threads)
    assert (tmp_path / "ours.safetensors").read_bytes() == stock_bytes(tensors, tmp_path / "stock.safetensors",
                                                                       metadata)
    loaded = load_file(tmp_path / "ours.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, tensor in tensors.items():
        assert loaded[name].dtype == tensor.dtype and torch.equal(loaded[name], tensor), name


def test_default_sizes_and_an_empty_file_match_save_file(tmp_path):
    tensors = every_kind_of_tensor()
    write_safetensors(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == stock_bytes(tensors, tmp_path / "stock.safetensors",
                                                                       {"format": "pt"})
    write_safetensors({}, tmp_path / "empty.safetensors", {"format": "pt"})
    assert (tmp_path / "empty.safetensors").read_bytes() == stock_bytes({}, tmp_path / "stock_empty.safetensors",
                                                                        {"format": "pt"})


def test_a_file_already_there_is_replaced_whole_with_save_files_permissions(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"x" * 10_000)
    write_safetensors({"a": torch.ones(2)}, path, {"format": "pt"})
    assert path.read_bytes() == stock_bytes({"a": torch.ones(2)}, tmp_path / "stock.safetensors", {"format": "pt"})
    assert stat.S_IMODE(path.stat().st_mode) == stat.S_IMODE((tmp_path / "stock.safetensors").stat().st_mode)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.safetensors", "stock.safetensors"]


def test_tensors_read_from_the_file_written_back_over_it_keep_their_values(tmp_path):
    """``load_file`` maps the file: writing in place over it would read the bytes being overwritten."""
    path = tmp_path / "model.safetensors"
    values = {"w": torch.randn(100_000), "b": torch.randn(7).to(torch.bfloat16)}
    save_file(values, str(path))
    write_safetensors(load_file(path), path, threads=3)
    loaded = load_file(path)
    assert all(torch.equal(loaded[name], values[name]) for name in values)


def test_a_failed_write_leaves_the_previous_file_and_no_temporary(tmp_path, monkeypatch):
    path = tmp_path / "model.safetensors"
    save_file({"old": torch.ones(3)}, str(path))
    before = path.read_bytes()
    writes = []

    def full_after_the_header(descriptor, data, offset):
        writes.append(offset)
        if len(writes) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return os.write(descriptor, data) if offset == 0 else len(data)

    monkeypatch.setattr(safetensors_writer.os, "pwrite", full_after_the_header)
    with pytest.raises(OSError, match=r"^\[Errno 28\] No space left on device: '.*model\.safetensors'$"):
        write_safetensors({"new": torch.randn(1000)}, path, {"format": "pt"}, threads=1)
    assert path.read_bytes() == before and [p.name for p in tmp_path.iterdir()] == ["model.safetensors"]


def test_save_files_refusals_and_views_are_kept(tmp_path):
    shared = torch.zeros(4, 4)
    with pytest.raises(RuntimeError, match="Some tensors share memory"):
        write_safetensors({"a": shared, "b": shared[:2]}, tmp_path / "shared.safetensors")
    with pytest.raises(TypeError, match=r"^safetensors tensor names must be strings; got 1$"):
        write_safetensors({1: torch.ones(2)}, tmp_path / "key.safetensors")  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=rf"^{tmp_path} is not a regular file; safetensors files are written as new "
                                         "files that replace the one at their path. Choose a file path.$"):
        write_safetensors({"w": torch.ones(2)}, tmp_path)
    assert list(tmp_path.iterdir()) == []
    rows = torch.arange(12.0).reshape(3, 4)  # disjoint rows of one storage are no sharing
    complex_values = torch.randn(3, dtype=torch.complex64)
    views = {"row0": rows[0], "row2": rows[2], "conj": complex_values.conj(), "neg": torch._neg_view(rows[1])}
    write_safetensors(views, tmp_path / "views.safetensors", threads=2)
    loaded = load_file(tmp_path / "views.safetensors")
    assert all(torch.equal(loaded[name], views[name].resolve_conj().resolve_neg()) for name in views)
    scales = torch.ones(2, 3, dtype=torch.float8_e8m0fnu).t()  # outside the table, not contiguous
    write_safetensors({"scales": scales}, tmp_path / "scales.safetensors")
    assert load_file(tmp_path / "scales.safetensors")["scales"].float().equal(scales.float())


def test_several_metadata_keys_are_the_same_header(tmp_path):
    """safetensors orders several metadata keys by its own hash map, so only the header's meaning can be equal."""
    metadata = {"z": "1", "a": "2", "format": "pt"}
    tensors = {"w": torch.arange(6.0).reshape(2, 3)}
    write_safetensors(tensors, tmp_path / "ours.safetensors", metadata)
    stock = stock_bytes(tensors, tmp_path / "stock.safetensors", metadata)
    ours = (tmp_path / "ours.safetensors").read_bytes()

    def header(data: bytes) -> dict:
        return json.loads(data[8:8 + struct.unpack("<Q", data[:8])[0]])

    assert header(ours) == header(stock) and len(ours) == len(stock)
    assert ours[-24:] == stock[-24:]


def test_a_dtype_outside_the_table_is_written_by_save_file(tmp_path):
    dtype = torch.float8_e8m0fnu
    assert dtype not in SAFETENSORS_DTYPES
    tensors = {"scales": torch.ones(4, dtype=dtype), "w": torch.ones(2, 2)}
    write_safetensors(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == stock_bytes(tensors, tmp_path / "stock.safetensors",
                                                                       {"format": "pt"})


def test_bad_input_is_refused_before_a_file_is_made(tmp_path):
    with pytest.raises(ValueError, match=r"^Tensor 'w' is on the meta device: it has no data to write$"):
        write_safetensors({"w": torch.empty(2, device="meta")}, tmp_path / "meta.safetensors")
    with pytest.raises(ValueError, match=r"^safetensors metadata must map strings to strings; got \{'n': 1\}$"):
        write_safetensors({"w": torch.ones(2)}, tmp_path / "meta.safetensors", {"n": 1})  # type: ignore[dict-item]
    assert not (tmp_path / "meta.safetensors").exists()


@pytest.mark.filterwarnings("ignore::ompmoe.engine.export.checkpoint.MissingTokenizerWarning")
def test_save_pruned_writes_its_shards_with_the_parallel_writer_and_the_bytes_of_save_pretrained(tmp_path,
                                                                                                monkeypatch):
    """The files equal stock ``save_pretrained``'s (one shard and several), and they were written by
    :func:`write_safetensors`: a transformers that stops calling ``safe_save_file`` fails here, not silently slow."""
    model = tiny_model("qwen3_moe")
    calls = []

    def spy(tensors, filename, metadata=None):
        calls.append(filename)
        write_safetensors(tensors, filename, metadata)

    monkeypatch.setattr(safetensors_writer, "write_safetensors", spy)
    for shard_size in (None, "200KB"):
        kwargs = {} if shard_size is None else {"max_shard_size": shard_size}
        stock, ours = tmp_path / f"stock-{shard_size}", tmp_path / f"ours-{shard_size}"
        model.save_pretrained(stock, **kwargs)
        before = len(calls)
        ompmoe.save_pruned(model, ours, **kwargs)
        weights = sorted(path.name for path in stock.iterdir() if path.name.startswith("model"))
        assert len(calls) - before == len([name for name in weights if name.endswith(".safetensors")])
        assert (len(weights) > 2) == (shard_size is not None)
        for name in weights:
            assert (ours / name).read_bytes() == (stock / name).read_bytes(), name
    assert modeling_utils.safe_save_file is not spy and modeling_utils.safe_save_file.__module__ == "safetensors.torch"


def test_the_stock_writer_is_put_back_when_the_save_fails():
    original = modeling_utils.safe_save_file
    with pytest.raises(RuntimeError, match="^disk gone$"):
        with parallel_pretrained_writes():
            assert modeling_utils.safe_save_file is not original
            raise RuntimeError("disk gone")
    assert modeling_utils.safe_save_file is original


def test_overlapping_saves_in_two_threads_leave_stock_behind_and_other_threads_use_stock(tmp_path, monkeypatch):
    """A enters, B enters, A leaves, B leaves: stock is back; meanwhile a third thread's save_file is stock's."""
    original = modeling_utils.safe_save_file
    used = []
    monkeypatch.setattr(safetensors_writer, "write_safetensors",
                        lambda tensors, filename, metadata=None: used.append(threading.current_thread().name))
    a_in, b_in, a_out, plain_done = (threading.Event() for _ in range(4))
    seen = {}

    def save_a():
        with parallel_pretrained_writes():
            a_in.set()
            b_in.wait()
            modeling_utils.safe_save_file({"w": torch.ones(1)}, str(tmp_path / "a.safetensors"), metadata=None)
        a_out.set()

    def save_b():
        a_in.wait()
        with parallel_pretrained_writes():
            b_in.set()
            a_out.wait()
            plain_done.wait()
            seen["patched_after_a_left"] = modeling_utils.safe_save_file is not original

    def plain():
        b_in.wait()
        modeling_utils.safe_save_file({"w": torch.ones(1)}, str(tmp_path / "plain.safetensors"), metadata=None)
        plain_done.set()

    threads = [threading.Thread(target=f, name=f.__name__) for f in (save_a, save_b, plain)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert used == ["save_a"] and (tmp_path / "plain.safetensors").is_file()
    assert seen == {"patched_after_a_left": True} and modeling_utils.safe_save_file is original


def test_contexts_that_end_out_of_order_count_and_a_writer_put_there_meanwhile_stays(monkeypatch):
    original = modeling_utils.safe_save_file
    used = []
    monkeypatch.setattr(safetensors_writer, "write_safetensors", lambda *args, **kwargs: used.append("ours"))

    def inside():
        with parallel_pretrained_writes():
            yield

    first, second = inside(), inside()
    next(first)
    next(second)
    first.close()  # the second context is still open: its saves stay ours
    modeling_utils.safe_save_file({"w": torch.ones(1)}, "unused", metadata=None)
    assert used == ["ours"]
    second.close()
    assert modeling_utils.safe_save_file is original
    replaced = object()
    with parallel_pretrained_writes():
        monkeypatch.setattr(modeling_utils, "safe_save_file", replaced)  # someone else's, put there meanwhile
    assert modeling_utils.safe_save_file is replaced


def test_without_pwrite_the_file_is_left_to_save_file(tmp_path, monkeypatch):
    monkeypatch.delattr(os, "pwrite")
    tensors = every_kind_of_tensor()
    write_safetensors(tensors, tmp_path / "ours.safetensors", {"format": "pt"})
    assert (tmp_path / "ours.safetensors").read_bytes() == stock_bytes(tensors, tmp_path / "stock.safetensors",
                                                                       {"format": "pt"})


def test_the_first_failed_piece_stops_the_pieces_not_started(tmp_path, monkeypatch):
    monkeypatch.setattr(safetensors_writer, "PIECE_BYTES", 100)
    calls = []

    def full(descriptor, data, offset):
        calls.append(offset)
        if offset == 0:
            return os.write(descriptor, data)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors_writer.os, "pwrite", full)
    with pytest.raises(OSError, match="No space left on device"):
        write_safetensors({"w": torch.randn(10_000)}, tmp_path / "m.safetensors", threads=2)  # 400 pieces
    assert len(calls) <= 1 + 2 + 2  # the header, and at most what the two threads had started
    assert list(tmp_path.iterdir()) == []


def test_copies_from_other_accelerators_run_one_at_a_time_across_threads_and_saves(tmp_path, monkeypatch):
    """Staged pieces of a non-CUDA device (CPU tensors sent through the buffers here) never copy at once."""
    monkeypatch.setattr(safetensors_writer, "PIECE_BYTES", 400)
    monkeypatch.setattr(safetensors_writer, "STAGING_BYTES", 400)
    monkeypatch.setattr(safetensors_writer, "needs_staging", lambda tensor: True)
    active, most = [0], [0]
    plain_bytes = safetensors_writer._bytes_of

    def slow_bytes(tensor):
        active[0] += 1
        most[0] = max(most[0], active[0])
        time.sleep(0.002)
        active[0] -= 1
        return plain_bytes(tensor)

    monkeypatch.setattr(safetensors_writer, "_bytes_of", slow_bytes)
    tensors = {"w": torch.randn(4_000), "v": torch.randn(2_000)}
    saves = [threading.Thread(target=write_safetensors, args=(tensors, tmp_path / f"{i}.safetensors"),
                              kwargs={"threads": 4}) for i in range(2)]
    for save in saves:
        save.start()
    for save in saves:
        save.join()
    assert most == [1]
    expected = stock_bytes(tensors, tmp_path / "stock.safetensors", None)
    assert all((tmp_path / f"{i}.safetensors").read_bytes() == expected for i in range(2))


def test_long_names_odd_arguments_and_the_metadata_name(tmp_path):
    long_name = tmp_path / ("x" * 240 + ".safetensors")  # the temporary file's name must still fit
    write_safetensors({"w": torch.ones(2)}, long_name)
    assert long_name.read_bytes() == stock_bytes({"w": torch.ones(2)}, tmp_path / "stock.safetensors", None)
    with pytest.raises(ValueError, match=r"^No tensor can be named '__metadata__': safetensors keeps a file's "
                                         r"metadata under it$"):
        write_safetensors({"__metadata__": torch.ones(1)}, tmp_path / "m.safetensors", {"format": "pt"})
    with pytest.raises(ValueError, match=r"^threads must be a positive whole number \(or None: one per core up to "
                                         r"8\); got 2\.5$"):
        write_safetensors({"w": torch.ones(1)}, tmp_path / "t.safetensors", threads=2.5)  # type: ignore[arg-type]
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "t.safetensors").exists()
