"""The opt-in skills set: 37 more train templates, each on another general shell skill (docs/tasks.md).

They live in the family modules (@skill) and are registered only by importing this module:
`--tasks-module nano_miles.tasks.catalog_skills` (tasks, rollout, eval) or `--set tasks_module=...` (train).
"""
from nano_miles.tasks.api import source_of
from nano_miles.tasks.catalog.common import SKILLS, register_in_order

register_in_order("""
passwd_home repeated_lines extract_range strip_comments group_mean distinct_ips paste_oldest nth_cheapest
delete_empty_files newer_than_marker heaviest_subdir broken_symlink split_pieces tar_extract_one tar_append
tar_member_size gzip_damaged json_top_value json_bump jsonl_ids umask_create find_exact_mode normalize_modes
and_or_chain stderr_last_line count_passing retry_until_ok heredoc_config max_arg_script substring
count_ext_script identical_files magic_bytes byte_at_offset date_add_days env_file set_mtime
""", SKILLS, "catalog_skills", source=source_of(__name__))  # registry order, never to change
