"""The opt-in skills set: 37 more train templates, each exercising another general shell skill.

They widen training beyond the built-in templates (which a policy fits: high train accuracy, held-out
pass@1 far lower): cut, paste, sort -t, uniq -d, sed ranges, awk conditions, find -newer/-empty/-xtype,
du, split, tar subsets, gzip -t, JSON edits, umask, && / ||, stderr, retries, here-documents, scripts
with arguments, od, dates... A third of them ask for a change to the workspace (held to account by a
check), then a value. None repeats or nearly copies a held-out template. They live in the family
modules (@skill) and are registered only by importing this module: `--tasks-module
nano_miles.tasks.catalog_skills` (tasks, rollout, eval) or `--set tasks_module=...` (train).
"""
import dataclasses

from nano_miles.tasks.api import register, source_of
from nano_miles.tasks.catalog.common import SKILLS

ORDER = """
passwd_home repeated_lines extract_range strip_comments group_mean distinct_ips paste_oldest nth_cheapest
delete_empty_files newer_than_marker heaviest_subdir broken_symlink split_pieces tar_extract_one tar_append
tar_member_size gzip_damaged json_top_value json_bump jsonl_ids umask_create find_exact_mode normalize_modes
and_or_chain stderr_last_line count_passing retry_until_ok heredoc_config max_arg_script substring
count_ext_script identical_files magic_bytes byte_at_offset date_add_days env_file set_mtime
""".split()  # registry order, never to change (see catalog/__init__.py)

if sorted(ORDER) != sorted(SKILLS):
    raise RuntimeError(f"catalog_skills ORDER and the skills set differ: {sorted(set(ORDER) ^ set(SKILLS))}")
for task_id in ORDER:
    register(dataclasses.replace(SKILLS[task_id], source=source_of(__name__)))
