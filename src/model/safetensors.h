/* Safetensors files: read (memory-mapped, or the header alone), validate, write.
 *
 * Format: 8-byte little-endian header length N, then N bytes of JSON (an object; may be
 * padded with trailing spaces), then the data section. Each tensor entry is
 *   "name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}
 * with offsets relative to the data section; "__metadata__" is an optional string->string map.
 * Validation follows the reference implementation: header length bounded (100,000,000 bytes)
 * and inside the file, JSON object, no duplicate names, known dtype, shape entries >= 0 with
 * no overflow, end - begin == product(shape) * dtype size, offsets contiguous from 0 with no
 * gap or overlap when sorted, and the last end equal to the data section's length. Every
 * violation is a PD_EFORMAT error naming the file and the tensor. */
#ifndef PD_MODEL_SAFETENSORS_H
#define PD_MODEL_SAFETENSORS_H

#include <stddef.h>
#include <stdint.h>

#include "core/err.h"

enum pd_st_dtype {
    PD_ST_BOOL, PD_ST_U8, PD_ST_I8, PD_ST_I16, PD_ST_U16, PD_ST_F16, PD_ST_BF16,
    PD_ST_I32, PD_ST_U32, PD_ST_F32, PD_ST_F64, PD_ST_I64, PD_ST_U64,
    PD_ST_F8_E4M3, PD_ST_F8_E5M2, PD_ST_F8_E8M0,
    PD_ST_DTYPE_COUNT
};

#define PD_ST_MAX_DIMS 8
#define PD_ST_MAX_HEADER 100000000ull

struct pd_st_tensor {
    char *name;
    enum pd_st_dtype dtype;
    int ndim;
    int64_t shape[PD_ST_MAX_DIMS];
    uint64_t begin, end;   /* byte offsets inside the data section */
    const void *data;      /* points into the mapping; NULL when opened header-only */
    unsigned char used;    /* pd_st_set_find has found it */
};

struct pd_st_file {
    char *path;
    void *map;             /* whole file mapped read-only (NULL when header-only) */
    size_t file_size;
    uint64_t header_len;
    struct pd_st_tensor *tensors;  /* sorted by name */
    size_t n;
};

enum { PD_ST_HEADER_ONLY = 1 };

/* Opens and validates a file. With PD_ST_HEADER_ONLY only the header is read (offsets are
 * still checked against the file's size); otherwise the file is mmap'ed. */
int pd_st_open(const char *path, int flags, struct pd_st_file *f, pd_err *e);
/* Validates an in-memory image of a whole file (the fuzzer's entry point); tensors' data
 * point into buf, which must outlive f. `label` names it in errors. */
int pd_st_parse(const void *buf, size_t len, const char *label, struct pd_st_file *f, pd_err *e);
void pd_st_close(struct pd_st_file *f);
/* From now on a SIGBUS on a page of a mapped file (one truncated or rewritten in place while
 * mapped) ends the process with a line naming the file, exit status 1; any other SIGBUS goes to
 * the handler installed before (call it after the libraries that install theirs: UCX). */
void pd_st_catch_truncation(void);
const struct pd_st_tensor *pd_st_find(const struct pd_st_file *f, const char *name);

size_t pd_st_dtype_size(enum pd_st_dtype d);          /* bytes per element */
const char *pd_st_dtype_name(enum pd_st_dtype d);     /* "F32", "BF16", "F8_E4M3", ... */
int pd_st_dtype_parse(const char *s, enum pd_st_dtype *d);  /* 0 or PD_EINVAL */

/* A checkpoint directory: model.safetensors, or shards listed by model.safetensors.index.json
 * ("weight_map": tensor name -> shard file). Every tensor of every shard is reachable. */
struct pd_st_set {
    struct pd_st_file *files;
    size_t nfiles;
};
int pd_st_open_dir(const char *dir, int flags, struct pd_st_set *s, pd_err *e);
void pd_st_close_dir(struct pd_st_set *s);
/* The tensor `name` of any file of s, or NULL; a tensor found is marked used. */
const struct pd_st_tensor *pd_st_set_find(const struct pd_st_set *s, const char *name);
/* Bytes of s's mappings the kernel maps in 2 MiB pages now (FilePmdMapped in /proc/self/smaps; 0
 * where it cannot tell). Each file of 2 MiB or more is mapped at a 2 MiB boundary with
 * MADV_HUGEPAGE, so the kernel can wherever it holds the file's page cache in 2 MiB folios. */
size_t pd_st_pmd_mapped_bytes(const struct pd_st_set *s);
/* For a writer, after fsync: the pages of a file of `size` bytes (2 MiB or more) written through
 * fd leave the page cache. The write path leaves them in 4 KiB folios, which a reader would then
 * map 4 KiB at a time; read cold under MADV_HUGEPAGE the file comes in 2 MiB folios where the
 * kernel does. Advice only (the data is on disk: its next read is from there). */
void pd_st_uncache(int fd, size_t size);
/* How many of s's tensors pd_st_set_find never found, those whose names start with `except` (if
 * not NULL) aside; *first names the first of them (in file order, then by name), *file its file. */
size_t pd_st_set_unused(const struct pd_st_set *s, const char *except, const char **first, const char **file);
/* The path of the file holding t (a tensor of s), for messages; "checkpoint" if none does. */
const char *pd_st_set_path_of(const struct pd_st_set *s, const struct pd_st_tensor *t);

/* Writing: tensors are written in the given order with contiguous offsets. */
struct pd_st_out {
    const char *name;
    enum pd_st_dtype dtype;
    int ndim;
    int64_t shape[PD_ST_MAX_DIMS];
    const void *data;      /* product(shape) * dtype size bytes */
};
int pd_st_write(const char *path, const struct pd_st_out *t, size_t n, pd_err *e);

#endif
