"""A file's version as the caches of vector files, SAEs and file digests key on it.

(device, inode, size, mtime, ctime), the times in nanoseconds: a file replaced or rewritten in
any way gets another version, even one rewritten in place with its size kept and its mtime put
back (the ctime changes with every write, and no user call sets it).
"""

from __future__ import annotations

import os

FileVersion = tuple[int, int, int, int, int]


def file_version(info: os.stat_result) -> FileVersion:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
