"""The opt-in training set nano_miles.tasks.catalog_skills (loaded with tasks_module, never by default).

It loads through load_task_modules with no problem line, adds only train tasks with new ids spread over the
families, leaves the held-out split as it is, and every one of its tasks is solved by its scripted solution
through the env in a real sandbox, with wrong and premature answers refused (the catalog's own test).
Loading registers tasks in the process-wide registry: every test here, and the collection below, puts the
registry back as it found it, so the other test files in the same run see the built-in tasks only.
"""
import collections
import sys

import pytest

from nano_miles import tasks
from nano_miles.tasks.api import TASKS
from nano_miles.tasks import load_task_modules, select_tasks
from tests.nano_miles.tasks.test_catalog import scripted_policy_solves_and_verifier_discriminates

MODULE = "nano_miles.tasks.catalog_skills"
FAMILIES = ("text", "files", "archives", "json", "permissions", "process", "scripts", "hashing", "system")


def load_skills() -> tuple[list[str], list]:
    """Import the module afresh through load_task_modules: (its problem lines, the tasks it registered)."""
    sys.modules.pop(MODULE, None)
    tasks._LOADED.pop(MODULE, None)
    before = set(TASKS)
    errors = load_task_modules([MODULE])
    return errors, [t for i, t in TASKS.items() if i not in before]


def snapshot():
    saved, loaded = dict(TASKS), dict(tasks._LOADED)

    def restore():
        TASKS.clear()
        TASKS.update(saved)
        tasks._LOADED.clear()
        tasks._LOADED.update(loaded)
        sys.modules.pop(MODULE, None)
    return restore


_restore = snapshot()
try:
    LOAD_ERRORS, SKILLS = load_skills()  # for parametrisation; the Task objects need no registry to run
finally:
    _restore()


@pytest.fixture(autouse=True)
def registry():
    """Each test starts from the built-in tasks and leaves the registry as it found it."""
    restore = snapshot()
    yield
    restore()


def test_loads_on_demand_only_and_without_problems():
    assert LOAD_ERRORS == []
    assert not any(t.source == MODULE for t in TASKS.values())   # not part of the default registry
    builtin = set(TASKS)
    errors, skills = load_skills()
    assert errors == [] and [t.id for t in skills] == [t.id for t in SKILLS]
    assert len(skills) >= 30 and all(t.source == MODULE for t in skills)
    assert not {t.id for t in skills} & builtin
    assert load_task_modules([MODULE]) == [] and len(TASKS) == len(builtin) + len(skills)  # a second load: no-op


def test_all_train_new_ids_spread_over_the_families():
    builtin = set(TASKS)
    assert all(t.split == "train" for t in SKILLS)
    ids = [t.id for t in SKILLS]
    assert len(ids) == len(set(ids)) and not set(ids) & builtin
    families = collections.Counter(t.family for t in SKILLS)
    assert set(families) <= set(FAMILIES), families
    assert all(families[f] >= 3 for f in FAMILIES), families
    assert sum(bool(t.summary) for t in SKILLS) == len(SKILLS)


def test_loading_leaves_the_heldout_split_alone():
    heldout, train = select_tasks("heldout"), select_tasks("train")
    assert load_skills()[0] == []
    assert select_tasks("heldout") == heldout
    assert [t.id for t in select_tasks("train")] == [t.id for t in train] + [t.id for t in SKILLS]


@pytest.mark.parametrize("task", SKILLS, ids=[t.id for t in SKILLS])
def test_scripted_policy_solves_and_verifier_discriminates(task):
    scripted_policy_solves_and_verifier_discriminates(task, seed=7)
