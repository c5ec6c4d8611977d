"""The built-in tasks, one module per family (what the tasks exercise), registered in a fixed order.

Each setup draws its parameters from the episode's rng, writes the workspace and computes the expected
answer by running real commands in the sandbox (ws.run). Task ids are stable: never rename one (results
and held-out splits refer to them). The held-out tasks are never trained on, and no training task
repeats a held-out template. Each family module also holds its part of the opt-in skills set, which
nano_miles.tasks.catalog_skills registers when a run asks for it.
"""
from nano_miles.tasks.catalog import (archives, files, hashing, json, permissions, process,  # noqa: F401 (they
                                      scripts, system, text)                                # fill BUILTIN, SKILLS)
from nano_miles.tasks.catalog.common import BUILTIN, register_in_order

# Registry order, never to change: a selection lists tasks in it, a group's instance seed comes from its
# task's index in the selection, and the training stream shuffles that list.
register_in_order("""
sha256_string numbers_file kernel_name python_product count_word unique_lines most_frequent sed_replace
csv_column_sum count_ext largest_file make_tree tar_count tar_extract_read json_field make_executable octal_mode
exit_status env_script sum_args_script grep_count_lines nth_line reverse_sort_first uppercase_file column_max
dedupe_file count_dirs file_with_token total_bytes copy_rename make_tarball gunzip_count json_count json_sum
json_write set_mode count_executables script_stdout_lines env_default loop_sum md5_file base64_decode
word_count_total join_total top_k_sum diff_count files_over_size rename_ext symlink_current gzip_logs
tar_newest_member json_keys json_lookup world_writable_file strip_other_perms pipe_status stdin_script
squares_script divmod sha1_created_file checksum_mismatch epoch_to_date days_between
""", BUILTIN, "catalog")
