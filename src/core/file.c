#include "core/file.h"

#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static const char *kind_of(mode_t m)
{
    return S_ISDIR(m) ? "a directory" : S_ISFIFO(m) ? "a FIFO" : S_ISCHR(m) ? "a character device"
         : S_ISBLK(m) ? "a block device" : S_ISSOCK(m) ? "a socket" : "a special file";
}

int pd_file_open(const char *path, pd_err *e)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return pd_err_set(e, PD_EIO, "%s: cannot open: %s", path, strerror(errno));
    struct stat st;
    if (fstat(fd, &st)) {
        int err = errno;
        close(fd);
        return pd_err_set(e, PD_EIO, "%s: %s", path, strerror(err));
    }
    if (!S_ISREG(st.st_mode)) {
        close(fd);
        return pd_err_set(e, PD_EIO, "%s: %s, not a regular file", path, kind_of(st.st_mode));
    }
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0) {
        int err = errno;
        close(fd);
        return pd_err_set(e, PD_EIO, "%s: %s", path, strerror(err));
    }
    return fd;
}

char *pd_file_read(const char *path, size_t max, size_t *len, pd_err *e)
{
    int fd = pd_file_open(path, e);
    if (fd < 0)
        return NULL;
    struct stat st;
    char *text = NULL;
    if (fstat(fd, &st)) {
        pd_err_set(e, PD_EIO, "%s: %s", path, strerror(errno));
        goto out;
    }
    if ((size_t)st.st_size > max) {
        pd_err_set(e, PD_EFORMAT, "%s: %lld bytes, more than the %zu such a file may hold", path,
                   (long long)st.st_size, max);
        goto out;
    }
    size_t n = (size_t)st.st_size, got = 0;
    if (!(text = malloc(n + 1))) {
        pd_err_set(e, PD_ENOMEM, "%s: out of memory for %zu bytes", path, n);
        goto out;
    }
    while (got < n) {
        ssize_t k = read(fd, text + got, n - got);
        if (k < 0 && errno == EINTR)
            continue;
        if (k <= 0) {
            pd_err_set(e, PD_EIO, "%s: %s after %zu of %zu bytes", path, k < 0 ? strerror(errno) : "ended", got, n);
            free(text);
            text = NULL;
            goto out;
        }
        got += (size_t)k;
    }
    text[n] = 0;
    if (len)
        *len = n;
out:
    close(fd);
    return text;
}

int pd_path_join(char *out, size_t cap, const char *dir, const char *name, pd_err *e)
{
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap)
        return pd_err_set(e, PD_EINVAL, "%.200s...: the path of its %s is longer than %zu bytes", dir, name, cap - 1);
    return 0;
}

int pd_dir_check(const char *flag, const char *dir, pd_err *e)
{
    struct stat st;
    if (stat(dir, &st))
        return pd_err_set(e, PD_EINVAL, "%s %s: %s", flag, dir,
                          errno == ENOENT ? "no such directory" : strerror(errno));
    if (!S_ISDIR(st.st_mode))
        return pd_err_set(e, PD_EINVAL, "%s %s: not a directory", flag, dir);
    return 0;
}
