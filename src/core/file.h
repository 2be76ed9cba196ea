/* Reading a model's files: only regular files (or links to them). A FIFO, a device or a socket
 * where a checkpoint's file should be would block the program or never end, and a directory is
 * no file; each is an error naming the path. */
#ifndef PD_CORE_FILE_H
#define PD_CORE_FILE_H

#include <stddef.h>

#include "core/err.h"

/* A read-only descriptor of path if it is a regular file, else a negative PD_E* code (PD_EIO)
 * with e naming the path and what it is. The open itself never blocks: O_NONBLOCK, cleared once
 * the file is known to be regular. */
int pd_file_open(const char *path, pd_err *e);

/* The whole of such a file, NUL-terminated (malloc'ed), *len its bytes without the NUL (len may
 * be NULL); NULL with e set if it cannot be read or holds more than max bytes (PD_EFORMAT). */
char *pd_file_read(const char *path, size_t max, size_t *len, pd_err *e);

/* dir + "/" + name into out (cap bytes): 0, or PD_EINVAL with e naming dir when the path does not
 * fit (a long directory once had its file name cut to "DIR/config." and the open's error blamed a
 * file nobody named). */
int pd_path_join(char *out, size_t cap, const char *dir, const char *name, pd_err *e);

/* 0 if dir, the value of flag ("--model"), is a directory; else PD_EINVAL with e naming the flag,
 * the path and what is wrong ("no such directory", "not a directory"): a model directory renamed
 * under a running cluster was reported as its tokenizer.json missing, the first file read. */
int pd_dir_check(const char *flag, const char *dir, pd_err *e);

#endif
