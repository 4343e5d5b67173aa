"""Files: atomic writes, guarded appends, and reads that fail with a message.

Writing (:func:`write_atomic`, used for every file oomless writes): the data goes
to a temporary file from :func:`tempfile.mkstemp` in the target's folder (an
unpredictable name opened ``O_CREAT | O_EXCL``: a symlink planted at ``NAME.tmp``
is never followed), is fsync'ed and ``os.replace``d over the target (a folder or a
device such as ``/dev/null`` is refused), then the folder is fsync'ed. Folders
(checkpoints, final weights) are built with :func:`new_temp_dir` and published
with :func:`publish_dir`; logs are appended through :func:`open_append`
(``O_NOFOLLOW``).

Reading: :func:`read_text` (a regular file, UTF-8; a bad byte names the file and
line), :func:`parse_json` (every JSON failure becomes the caller's error class)
and :func:`read_jsonl` (JSON-lines logs split on ``\\n`` only; a torn last line
is skipped and reported).

Guarding: nothing replaces one of a command's inputs (:func:`refuse_inputs`) or a
file oomless did not write unless ``--force``, and then the old file is kept as
``NAME.orig`` (:func:`keep_orig`, :class:`OutputFolder`).
"""

from __future__ import annotations

from .guarding import (
    ORIG,
    OutputFolder,
    ensure_folder,
    keep_orig,
    refuse_inputs,
    same_file,
    sha256_file,
)
from .reading import (
    MAX_CONFIG_BYTES,
    JsonLines,
    decode_utf8,
    parse_json,
    parse_jsonl,
    read_bytes,
    read_json,
    read_jsonl,
    read_text,
    split_lines,
)
from .writing import (
    check_output_file,
    cut_torn_tail,
    fsync_dir,
    new_temp_dir,
    open_append,
    publish_dir,
    write_atomic,
    write_json_atomic,
)

__all__ = ["MAX_CONFIG_BYTES", "ORIG", "JsonLines", "OutputFolder", "check_output_file",
           "cut_torn_tail", "decode_utf8", "ensure_folder", "fsync_dir", "keep_orig",
           "new_temp_dir", "open_append", "parse_json", "parse_jsonl", "publish_dir",
           "read_bytes", "read_json", "read_jsonl", "read_text", "refuse_inputs", "same_file",
           "sha256_file", "split_lines", "write_atomic", "write_json_atomic"]
