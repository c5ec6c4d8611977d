"""What the family modules share: random words and tokens, `ask`, and the decorators that collect the
built-in tasks (registered by catalog/__init__.py) and the opt-in skills set (by catalog_skills.py)."""
import dataclasses
import random

from nano_miles.tasks.api import Task, TaskInstance, Workspace, register

WORDS = ("apple", "river", "stone", "cloud", "tiger", "maple", "ember", "frost", "lemon", "otter",
         "pixel", "quartz", "raven", "solar", "tulip", "umber", "violet", "willow", "yarrow", "zephyr",
         "amber", "basil", "cedar", "delta", "eagle", "fjord", "garnet", "harbor", "iris", "juniper")
SHA = "sha256sum | cut -d' ' -f1"
BUILTIN: dict[str, Task] = {}
SKILLS: dict[str, Task] = {}


def _collect_into(tasks: dict[str, Task]):
    def decorator(id: str, family: str, split: str, summary: str, seed_task: bool = False):
        def decorate(fn):
            tasks[id] = Task(id, family, split, summary, fn, seed_task=seed_task, source=fn.__module__)
            return fn
        return decorate
    return decorator


# Like @task, kept here until catalog/__init__.py (builtin) or catalog_skills.py (skill, opt-in) registers them.
builtin, skill = _collect_into(BUILTIN), _collect_into(SKILLS)


def register_in_order(order: str, tasks: dict[str, Task], what: str, source: str | None = None) -> None:
    """Register `tasks` in `order` (their ids, whitespace-separated), which must name each exactly once."""
    ids = order.split()
    if sorted(ids) != sorted(tasks):
        raise RuntimeError(f"{what} ORDER and its tasks differ: {sorted(set(ids) ^ set(tasks))}")
    for task_id in ids:
        register(tasks[task_id] if source is None else dataclasses.replace(tasks[task_id], source=source))


def ask(ws: Workspace, instruction: str, cmd: str, kind: str = "text") -> TaskInstance:
    """A task whose answer is what `cmd` prints, and whose scripted solution is `cmd` itself."""
    return TaskInstance(instruction, ws.run(cmd), kind, solution=[cmd])


def token(rng: random.Random, n: int = 10) -> str:
    return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz0123456789") for _ in range(n))


def distinct_tokens(rng: random.Random, count: int, n: int = 6) -> list[str]:
    """`count` different tokens of the same length (so globs list them in the same order everywhere)."""
    out: list[str] = []
    while len(out) < count:
        t = token(rng, n)
        if t not in out:
            out.append(t)
    return out


def lines_of_words(rng: random.Random, n: int, vocab: int = 8) -> list[str]:
    pool = rng.sample(WORDS, vocab)
    return [rng.choice(pool) for _ in range(n)]
