"""Removing a sandbox's directories never reaches outside them, whatever a command does meanwhile.

The removal (and the disk walk, which shares workspace.walk) goes down by name and back up by "..".
A command still running (or sharing our uid in the tiers without namespaces) can move the directory
the walk is in to somewhere else: ".." then leads out of the tree, and the names still to do at the
level above would be looked up in the wrong directory. The walk checks that ".." is the directory it
came from, and stops (Moved) when it is not; the removal then reports it unfinished and is retried.
"""

import os
import time

from nano_openshell import workspace as workspace_mod

INF = float("inf")


def _tree_with_neighbour(tmp_path):
    """tree/{a/b, k0..k7} to remove, and outside/{k0..k7}/precious with the same names beside it."""
    tree, outside = tmp_path / "tree", tmp_path / "outside"
    (tree / "a" / "b").mkdir(parents=True)
    for i in range(8):
        (tree / f"k{i}").mkdir()
        (outside / f"k{i}").mkdir(parents=True)
        (outside / f"k{i}" / "precious").write_text("host data")
    return tree, outside


def test_a_directory_moved_out_of_the_tree_mid_removal_stops_it_there(tmp_path, monkeypatch):
    tree, outside = _tree_with_neighbour(tmp_path)
    b_ident = os.stat(tree / "a" / "b").st_ino
    real_listing = workspace_mod._opened_up_listing

    def listing_then_the_command_moves_a(fd, count, deadline):
        names = real_listing(fd, count, deadline)
        if os.fstat(fd).st_ino == b_ident:  # the walk is in tree/a/b: move tree/a under outside/
            os.rename(tree / "a", outside / "a")
        return names

    monkeypatch.setattr(workspace_mod, "_opened_up_listing", listing_then_the_command_moves_a)
    assert workspace_mod.remove(str(tree), INF) is False
    # ".." of a led to outside/: the walk stopped there, so outside's directories of the same names
    # as those still to do in tree/, and the moved directory itself, are untouched
    assert all((outside / f"k{i}" / "precious").read_text() == "host data" for i in range(8))
    assert (outside / "a").is_dir()
    monkeypatch.setattr(workspace_mod, "_opened_up_listing", real_listing)
    assert workspace_mod.remove(str(tree), INF) is True  # the retry (the background remover's) finishes
    assert not tree.exists()


def test_the_disk_walk_measures_again_when_a_directory_moves_under_it(tmp_path, monkeypatch):
    from nano_openshell import disk

    tree, outside = _tree_with_neighbour(tmp_path)
    (outside / "big").write_bytes(b"x" * (1 << 20))  # counted only if the walk strayed into outside/
    b_ident = os.stat(tree / "a" / "b").st_ino
    real_list = disk.Meter._list
    moves = []

    def list_then_the_command_moves_a(self, dirs, d, fd, *args):
        listed = real_list(self, dirs, d, fd, *args)
        if os.fstat(fd).st_ino == b_ident and not moves:  # once, while the walk is in tree/a/b
            os.rename(tree / "a", outside / "a")
            moves.append(1)
        return listed

    monkeypatch.setattr(disk.Meter, "_list", list_then_the_command_moves_a)
    used = disk.usage([str(tree)])
    assert moves == [1]
    assert used == 8 * disk.MIN_ENTRY_BYTES  # the second walk: tree/k0..k7, nothing of outside/


def test_the_disk_walk_gives_up_on_directories_that_keep_moving(tmp_path, monkeypatch):
    """A command that moves a directory between two parents all the time cuts every pass short there,
    and what the walk would reach after it would never be looked at: after three passes in a row the
    check gives up (the command is killed: the files cannot be measured)."""
    import errno

    import pytest

    from nano_openshell import disk

    (tmp_path / "p" / "a").mkdir(parents=True)
    (tmp_path / "q").mkdir()
    a_ident = os.stat(tmp_path / "p" / "a").st_ino
    real_visit = disk.Meter._visit

    def visit_then_the_command_moves_a(self, dirs, fd, *args):
        subdirs = real_visit(self, dirs, fd, *args)
        if os.fstat(fd).st_ino == a_ident:  # the walk is in a: over to the other parent
            here, there = ("p", "q") if (tmp_path / "p" / "a").exists() else ("q", "p")
            os.rename(tmp_path / here / "a", tmp_path / there / "a")
        return subdirs

    monkeypatch.setattr(disk.Meter, "_visit", visit_then_the_command_moves_a)
    with pytest.raises(OSError) as e:
        disk.usage([str(tmp_path)])
    assert e.value.errno == errno.ESTALE
    check = disk.DiskCheck(disk.Meter(), [str(tmp_path)], 1 << 30)  # a command's check, its passes in a thread
    end = time.monotonic() + 30
    while (line := check.over(time.monotonic())) is None and time.monotonic() < end:
        time.sleep(0.01)
    check.finish(time.monotonic())
    assert line is not None and "kept moving" in line and "killed" in line, line
