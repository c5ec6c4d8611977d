"""Read a trajectories JSONL (`eval --out`, `rollout --out`, bench/multi_gpu.sh TRAJ=1) as text.

  PYTHONPATH=. .venv/bin/python bench/episodes.py FILE.jsonl [--model NAME_OR_DIR] [--per-task N] [--task ID]

Prints how the episodes ended, counted by (turns, exec_ok, correct) -- a policy that pads its
episodes for the shaping shows up there first -- then pass@1 by task, then the first N episodes of
each task decoded with the model's tokenizer: the policy's turns and the tool turns between them,
as the policy saw them.
"""
from __future__ import annotations

import argparse
import collections
import json
import sys

from nano_miles.models.prepare import load_tokenizer


def load(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def summary(episodes: list[dict]) -> list[str]:
    ends = collections.Counter((e["num_turns"], e["reward_components"].get("exec_ok", 0.0),
                                e["reward_components"].get("correct", 0.0)) for e in episodes)
    lines = [f"{len(episodes)} episodes; (turns, exec_ok, correct): count"]
    lines += [f"  {key}: {n}" for key, n in ends.most_common()]
    by_task = collections.defaultdict(list)
    for e in episodes:
        by_task[e["task_id"]].append(e["reward_components"].get("correct", 0.0))
    lines.append("pass@1 by task:")
    lines += [f"  {task:<28} {sum(v) / len(v):.3f}  ({len(v)} episodes)" for task, v in sorted(by_task.items())]
    return lines


def decoded(episodes: list[dict], tokenizer, per_task: int, only_task: str | None) -> list[str]:
    shown, lines = collections.Counter(), []
    for e in episodes:
        task = e["task_id"]
        if (only_task and task != only_task) or shown[task] >= per_task:
            continue
        shown[task] += 1
        lines.append(f"===== {task}  reward {e['reward']}  turns {e['num_turns']}  ({e['finish_reason']})")
        lines.append(tokenizer.decode(e["response_ids"]))
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path", help="a trajectories JSONL file")
    p.add_argument("--model", default="qwen2.5-coder-0.5b-instruct", help="whose tokenizer decodes the ids")
    p.add_argument("--per-task", type=int, default=1, help="episodes decoded per task (0: none)")
    p.add_argument("--task", default=None, help="decode this task's episodes only")
    args = p.parse_args(argv)
    try:
        episodes = load(args.path)
    except (OSError, ValueError) as e:
        print(f"episodes: cannot read {args.path}: {e}", file=sys.stderr)
        return 2
    print("\n".join(summary(episodes)))
    if args.per_task > 0:
        print("\n".join(decoded(episodes, load_tokenizer(args.model), args.per_task, args.task)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
