"""The task catalog's ids, splits and families, in registry order: a spec that must not drift.

Results, held-out splits and checkpoints refer to task ids, so none may be renamed, moved to another
split or family, or dropped. The order matters too: a selection lists tasks in registry order, each
group's instance seed comes from its task's index there (rollout.episode.group_key), and the training
stream shuffles that list, so reordering would change which instances an eval scores and which tasks a
resumed run takes next.
"""
import sys

from nano_miles import tasks
from nano_miles.tasks import TASKS, load_task_modules

BUILTIN = """
sha256_string       train    hashing
numbers_file        train    files
kernel_name         train    system
python_product      train    scripts
count_word          train    text
unique_lines        train    text
most_frequent       train    text
sed_replace         train    text
csv_column_sum      train    text
count_ext           train    files
largest_file        train    files
make_tree           train    files
tar_count           train    archives
tar_extract_read    train    archives
json_field          train    json
make_executable     train    permissions
octal_mode          train    permissions
exit_status         train    process
env_script          train    process
sum_args_script     train    scripts
grep_count_lines    heldout  text
nth_line            heldout  text
reverse_sort_first  heldout  text
uppercase_file      heldout  text
column_max          heldout  text
dedupe_file         heldout  text
count_dirs          heldout  files
file_with_token     heldout  files
total_bytes         heldout  files
copy_rename         heldout  files
make_tarball        heldout  archives
gunzip_count        heldout  archives
json_count          heldout  json
json_sum            heldout  json
json_write          heldout  json
set_mode            heldout  permissions
count_executables   heldout  permissions
script_stdout_lines heldout  process
env_default         heldout  process
loop_sum            heldout  scripts
md5_file            heldout  hashing
base64_decode       heldout  hashing
word_count_total    heldout  text
join_total          train    text
top_k_sum           train    text
diff_count          train    text
files_over_size     train    files
rename_ext          train    files
symlink_current     train    files
gzip_logs           train    archives
tar_newest_member   train    archives
json_keys           train    json
json_lookup         train    json
world_writable_file train    permissions
strip_other_perms   train    permissions
pipe_status         train    process
stdin_script        train    process
squares_script      train    scripts
divmod              train    scripts
sha1_created_file   train    hashing
checksum_mismatch   train    hashing
epoch_to_date       train    system
days_between        train    system
"""

SKILLS = """
passwd_home        train    text
repeated_lines     train    text
extract_range      train    text
strip_comments     train    text
group_mean         train    text
distinct_ips       train    text
paste_oldest       train    text
nth_cheapest       train    text
delete_empty_files train    files
newer_than_marker  train    files
heaviest_subdir    train    files
broken_symlink     train    files
split_pieces       train    files
tar_extract_one    train    archives
tar_append         train    archives
tar_member_size    train    archives
gzip_damaged       train    archives
json_top_value     train    json
json_bump          train    json
jsonl_ids          train    json
umask_create       train    permissions
find_exact_mode    train    permissions
normalize_modes    train    permissions
and_or_chain       train    process
stderr_last_line   train    process
count_passing      train    process
retry_until_ok     train    process
heredoc_config     train    scripts
max_arg_script     train    scripts
substring          train    scripts
count_ext_script   train    scripts
identical_files    train    hashing
magic_bytes        train    hashing
byte_at_offset     train    hashing
date_add_days      train    system
env_file           train    system
set_mtime          train    system
"""  # the opt-in set: --tasks-module nano_miles.tasks.catalog_skills


def rows(spec: str) -> list[tuple[str, str, str]]:
    return [tuple(line.split()) for line in spec.strip().splitlines()]


def test_the_builtin_catalog_is_the_spec_in_order():
    assert [(t.id, t.split, t.family) for t in TASKS.values() if t.source.startswith("nano_miles.tasks.catalog")
            and t.source != "nano_miles.tasks.catalog_skills"] == rows(BUILTIN)


def test_the_opt_in_skills_set_is_the_spec_in_order():
    saved, loaded = dict(TASKS), dict(tasks._LOADED)
    try:
        sys.modules.pop("nano_miles.tasks.catalog_skills", None)
        tasks._LOADED.pop("nano_miles.tasks.catalog_skills", None)
        assert load_task_modules(["nano_miles.tasks.catalog_skills"]) == []
        assert [(t.id, t.split, t.family) for t in TASKS.values() if t.id not in saved] == rows(SKILLS)
    finally:
        TASKS.clear()
        TASKS.update(saved)
        tasks._LOADED.clear()
        tasks._LOADED.update(loaded)
        sys.modules.pop("nano_miles.tasks.catalog_skills", None)
