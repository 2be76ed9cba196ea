/* oneDNN int8 matmul wrapper (see onednn.h): one primitive per shape, weights reordered once. */
#include "bench/onednn.h"

#include <dnnl.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>

struct pd_onednn_mm {
    dnnl_engine_t eng;
    dnnl_stream_t stream;
    dnnl_primitive_t prim;
    dnnl_memory_t src, wei, dst;
    void *wei_buf;   /* the reordered weights */
    dnnl_memory_t scratch;
    void *scratch_buf;
};

static int fail(pd_err *err, dnnl_status_t st, const char *what)
{
    return pd_err_set(err, st == dnnl_out_of_memory ? PD_ENOMEM : PD_EINVAL,
                      "oneDNN: %s failed (status %d)", what, (int)st);
}

#define CHECK(call, what)                                                                        \
    do {                                                                                         \
        dnnl_status_t st_ = (call);                                                              \
        if (st_ != dnnl_success) {                                                               \
            rc = fail(err, st_, what);                                                           \
            goto done;                                                                           \
        }                                                                                        \
    } while (0)

/* The matmul of T rows of a ([T, in], type at) by w ([out, in], type wt) into y ([T, out], type yt),
 * with per-column output scales when w_scale is not NULL. */
static int mm_create(int T, int out, int in, const void *w, dnnl_data_type_t at, dnnl_data_type_t wt,
                     dnnl_data_type_t yt, const float *w_scale, pd_onednn_mm **mmp, pd_err *err)
{
    *mmp = NULL;
    pd_onednn_mm *mm = calloc(1, sizeof *mm);
    if (!mm)
        return pd_err_set(err, PD_ENOMEM, "oneDNN matmul: out of memory");
    int rc = 0;
    dnnl_primitive_attr_t attr = NULL;
    dnnl_primitive_desc_t pd = NULL, rpd = NULL;
    dnnl_primitive_t reorder = NULL;
    dnnl_memory_t user_w = NULL;
    CHECK(dnnl_engine_create(&mm->eng, dnnl_cpu, 0), "engine_create");
    CHECK(dnnl_stream_create(&mm->stream, mm->eng, dnnl_stream_default_flags), "stream_create");

    /* a: [T, in] row-major; w: logical [in, out] stored as pdmoe's [out, in] (tag ba). */
    dnnl_dims_t a_dims = {T, in}, w_dims = {in, out}, y_dims = {T, out};
    dnnl_memory_desc_t a_md, w_user_md, w_any_md, y_md;
    CHECK(dnnl_memory_desc_init_by_tag(&a_md, 2, a_dims, at, dnnl_ab), "src desc");
    CHECK(dnnl_memory_desc_init_by_tag(&w_user_md, 2, w_dims, wt, dnnl_ba), "weights desc");
    CHECK(dnnl_memory_desc_init_by_tag(&w_any_md, 2, w_dims, wt, dnnl_format_tag_any), "weights desc (any)");
    CHECK(dnnl_memory_desc_init_by_tag(&y_md, 2, y_dims, yt, dnnl_ab), "dst desc");
    CHECK(dnnl_primitive_attr_create(&attr), "attr_create");
    CHECK(dnnl_primitive_attr_set_scratchpad_mode(attr, dnnl_scratchpad_mode_user), "scratchpad mode");
    if (w_scale)   /* one scale per output column (mask: dimension 1) */
        CHECK(dnnl_primitive_attr_set_output_scales(attr, out, 1 << 1, w_scale), "output scales");
    dnnl_matmul_desc_t md;
    CHECK(dnnl_matmul_desc_init(&md, &a_md, &w_any_md, NULL, &y_md), "matmul_desc_init");
    CHECK(dnnl_primitive_desc_create(&pd, &md, attr, mm->eng, NULL), "matmul primitive_desc_create");
    CHECK(dnnl_primitive_create(&mm->prim, pd), "matmul primitive_create");

    const dnnl_memory_desc_t *w_md = dnnl_primitive_desc_query_md(pd, dnnl_query_weights_md, 0);
    const dnnl_memory_desc_t *s_md = dnnl_primitive_desc_query_md(pd, dnnl_query_scratchpad_md, 0);
    size_t wbytes = dnnl_memory_desc_get_size(w_md), sbytes = s_md ? dnnl_memory_desc_get_size(s_md) : 0;
    if (posix_memalign(&mm->wei_buf, 64, wbytes ? wbytes : 64) ||
        posix_memalign(&mm->scratch_buf, 64, sbytes ? sbytes : 64)) {
        rc = pd_err_set(err, PD_ENOMEM, "oneDNN matmul: out of memory for %zu bytes of weights", wbytes);
        goto done;
    }
    CHECK(dnnl_memory_create(&mm->wei, w_md, mm->eng, mm->wei_buf), "weights memory");
    if (s_md)
        CHECK(dnnl_memory_create(&mm->scratch, s_md, mm->eng, mm->scratch_buf), "scratchpad memory");
    CHECK(dnnl_memory_create(&user_w, &w_user_md, mm->eng, (void *)w), "user weights memory");
    CHECK(dnnl_reorder_primitive_desc_create(&rpd, &w_user_md, mm->eng, w_md, mm->eng, NULL),
          "weights reorder desc");
    CHECK(dnnl_primitive_create(&reorder, rpd), "weights reorder");
    dnnl_exec_arg_t rargs[2] = {{DNNL_ARG_FROM, user_w}, {DNNL_ARG_TO, mm->wei}};
    CHECK(dnnl_primitive_execute(reorder, mm->stream, 2, rargs), "weights reorder execute");
    CHECK(dnnl_stream_wait(mm->stream), "stream_wait");
    CHECK(dnnl_memory_create(&mm->src, &a_md, mm->eng, DNNL_MEMORY_NONE), "src memory");
    CHECK(dnnl_memory_create(&mm->dst, &y_md, mm->eng, DNNL_MEMORY_NONE), "dst memory");
done:
    if (reorder)
        dnnl_primitive_destroy(reorder);
    if (rpd)
        dnnl_primitive_desc_destroy(rpd);
    if (user_w)
        dnnl_memory_destroy(user_w);
    if (pd)
        dnnl_primitive_desc_destroy(pd);
    if (attr)
        dnnl_primitive_attr_destroy(attr);
    if (rc < 0) {
        pd_onednn_mm_free(mm);
        return rc;
    }
    *mmp = mm;
    return 0;
}

int pd_onednn_mm_create(int T, int out, int in, const int8_t *w, const float *w_scale,
                        enum pd_onednn_dst dst, pd_onednn_mm **mm, pd_err *err)
{
    *mm = NULL;
    if (T < 1 || out < 1 || in < 1 || !w || (dst == PD_ONEDNN_F32 && !w_scale))
        return pd_err_set(err, PD_EINVAL, "oneDNN matmul: bad shape [%d, %d] x [%d, %d]^T or "
                          "missing weights/scales", T, in, out, in);
    return mm_create(T, out, in, w, dnnl_s8, dnnl_s8, dst == PD_ONEDNN_F32 ? dnnl_f32 : dnnl_s32,
                     dst == PD_ONEDNN_F32 ? w_scale : NULL, mm, err);
}

int pd_onednn_mm_create_f32(int T, int out, int in, const float *w, pd_onednn_mm **mm, pd_err *err)
{
    *mm = NULL;
    if (T < 1 || out < 1 || in < 1 || !w)
        return pd_err_set(err, PD_EINVAL, "oneDNN f32 matmul: bad shape [%d, %d] x [%d, %d]^T or missing weights", T,
                          in, out, in);
    return mm_create(T, out, in, w, dnnl_f32, dnnl_f32, dnnl_f32, NULL, mm, err);
}

int pd_onednn_mm_run(pd_onednn_mm *mm, const void *a, void *y, pd_err *err)
{
    int rc = 0;
    CHECK(dnnl_memory_set_data_handle(mm->src, (void *)a), "src handle");
    CHECK(dnnl_memory_set_data_handle(mm->dst, y), "dst handle");
    dnnl_exec_arg_t args[4] = {{DNNL_ARG_SRC, mm->src}, {DNNL_ARG_WEIGHTS, mm->wei},
                               {DNNL_ARG_DST, mm->dst}, {DNNL_ARG_SCRATCHPAD, mm->scratch}};
    CHECK(dnnl_primitive_execute(mm->prim, mm->stream, mm->scratch ? 4 : 3, args), "matmul execute");
    CHECK(dnnl_stream_wait(mm->stream), "stream_wait");
done:
    return rc;
}

void pd_onednn_mm_free(pd_onednn_mm *mm)
{
    if (!mm)
        return;
    if (mm->prim)
        dnnl_primitive_destroy(mm->prim);
    if (mm->src)
        dnnl_memory_destroy(mm->src);
    if (mm->wei)
        dnnl_memory_destroy(mm->wei);
    if (mm->dst)
        dnnl_memory_destroy(mm->dst);
    if (mm->scratch)
        dnnl_memory_destroy(mm->scratch);
    if (mm->stream)
        dnnl_stream_destroy(mm->stream);
    if (mm->eng)
        dnnl_engine_destroy(mm->eng);
    free(mm->wei_buf);
    free(mm->scratch_buf);
    free(mm);
}

void pd_onednn_threads(int n)
{
    omp_set_num_threads(n);
}

int pd_onednn_int8_exact(void)
{
    return __builtin_cpu_supports("avx512vnni") || __builtin_cpu_supports("avxvnni") ||
           __builtin_cpu_supports("amx-int8");
}

const char *pd_onednn_version(void)
{
    static char buf[32];
    const dnnl_version_t *v = dnnl_version();
    snprintf(buf, sizeof buf, "%d.%d.%d", v->major, v->minor, v->patch);
    return buf;
}
