/* Non-negative least squares over three unknowns (calibrate.h): the best over every subset of
 * unknowns left free (the others at zero, the empty subset included) whose normal equations
 * give no negative value. The
 * third unknown is a factor's excess cost d = 1/factor - 1 >= 0. */
#include "plan/calibrate.h"
#include "plan/perf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Solves the k x k system a x = b (k <= 3) by Gaussian elimination; -1 if singular. */
static int solve(int k, double a[3][3], double b[3], double x[3])
{
    for (int c = 0; c < k; c++) {
        int piv = c;
        for (int r = c + 1; r < k; r++)
            if (fabs(a[r][c]) > fabs(a[piv][c]))
                piv = r;
        if (fabs(a[piv][c]) < 1e-300)
            return -1;
        for (int j = 0; j < k; j++) {
            double t = a[c][j];
            a[c][j] = a[piv][j];
            a[piv][j] = t;
        }
        double t = b[c];
        b[c] = b[piv];
        b[piv] = t;
        for (int r = c + 1; r < k; r++) {
            double m = a[r][c] / a[c][c];
            for (int j = c; j < k; j++)
                a[r][j] -= m * a[c][j];
            b[r] -= m * b[c];
        }
    }
    for (int c = k - 1; c >= 0; c--) {
        double s = b[c];
        for (int j = c + 1; j < k; j++)
            s -= a[c][j] * x[j];
        x[c] = s / a[c][c];
    }
    return 0;
}

/* The known part G of a step's time and the regressors of its three unknowns (calibrate.h):
 * measured = G + step_s x X[0] + token_layer_s x X[1] + d x X[2], d = 1 / factor - 1 >= 0. */
static void regressors(const struct pd_plan *p, const struct pd_calib_point *pt, double attention, double *G,
                       double X[3])
{
    struct pd_step s;
    pd_perf_step(p, pt->role, pt->seqs, pt->tokens, pt->ctx, &s);
    X[0] = 1;
    X[1] = (double)(pt->seqs * pt->tokens) * p->kv.n;
    if (attention > 0) {      /* decode: attention known, the weight stream's factor fitted */
        *G = s.gemm_compute_s + s.attn_s / attention;
        X[2] = s.gemm_memory_s * p->hw.eff.memory;
    } else {                  /* prefill: the GEMMs known, attention's factor fitted */
        *G = s.gemm_compute_s + s.gemm_memory_s;
        X[2] = s.attn_s;
    }
    /* the factor is at most 1 (no kernel beats the peak): its column's coefficient 1/factor is
     * 1 + d with d >= 0, the "1" moved into the known part */
    *G += X[2];
}

int pd_calib_fit(const struct pd_plan *p, struct pd_calib_point *pts, int n, double attention,
                 struct pd_calib_fit *f, pd_err *e)
{
    memset(f, 0, sizeof *f);
    if (n < 3)
        return pd_err_set(e, PD_EINVAL, "%d measurements, at least 3 needed", n);
    double X[64][3], y[64], G[64];
    if (n > 64)
        n = 64;
    for (int i = 0; i < n; i++) {
        regressors(p, &pts[i], attention, &G[i], X[i]);
        y[i] = pts[i].measured_s - G[i];
    }
    /* relative errors matter: weight each row by 1 / measured */
    double best_err = INFINITY, best[3] = {0, 0, 0};
    /* mask 0, every unknown at its bound, is always feasible: a non-negative fit always exists */
    for (int mask = 0; mask < 8; mask++) {
        int idx[3], k = 0;
        for (int j = 0; j < 3; j++)
            if (mask >> j & 1)
                idx[k++] = j;
        double a[3][3] = {{0}}, b[3] = {0}, x[3] = {0};
        for (int i = 0; i < n; i++) {
            double w = 1 / (pts[i].measured_s * pts[i].measured_s);
            for (int r = 0; r < k; r++) {
                b[r] += w * X[i][idx[r]] * y[i];
                for (int c = 0; c < k; c++)
                    a[r][c] += w * X[i][idx[r]] * X[i][idx[c]];
            }
        }
        if (k && solve(k, a, b, x))
            continue;
        int neg = 0;
        for (int r = 0; r < k; r++)
            neg |= x[r] < 0;
        if (neg)
            continue;
        double full[3] = {0, 0, 0}, err = 0;
        for (int r = 0; r < k; r++)
            full[idx[r]] = x[r];
        for (int i = 0; i < n; i++) {
            double fit = G[i] + full[0] * X[i][0] + full[1] * X[i][1] + full[2] * X[i][2];
            err += pow((fit - pts[i].measured_s) / pts[i].measured_s, 2);
        }
        if (err < best_err) {
            best_err = err;
            memcpy(best, full, sizeof best);
        }
    }
    if (!isfinite(best_err))
        return pd_err_set(e, PD_EINVAL, "the %s steps' times are not positive finite numbers",
                          attention > 0 ? "decode" : "prefill");
    f->step_s = best[0];
    f->token_layer_s = best[1];
    double factor = 1 / (1 + best[2]);
    f->attention = attention > 0 ? attention : factor;
    f->memory = attention > 0 ? factor : p->hw.eff.memory;
    for (int i = 0; i < n; i++)
        pts[i].fitted_s = G[i] + best[0] * X[i][0] + best[1] * X[i][1] + best[2] * X[i][2];
    f->rms_rel = sqrt(best_err / n);
    return 0;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* A fit's coefficient of unknown k (its factor as d = 1 / factor - 1 for k = 2). */
static double coef(const struct pd_calib_fit *f, int k, double attention)
{
    return k == 0 ? f->step_s : k == 1 ? f->token_layer_s : 1 / (attention > 0 ? f->memory : f->attention) - 1;
}

int pd_calib_fit_rounds(const struct pd_plan *p, struct pd_calib_point *pts, int n, const double *t, int rounds,
                        double attention, struct pd_calib_rounds *r, pd_err *e)
{
    memset(r, 0, sizeof *r);
    r->rounds = rounds;
    r->undetermined = 7;
    if (n < 3 || n > 64 || rounds < 1)
        return pd_err_set(e, PD_EINVAL, "%d points in %d rounds; 3 to 64 points and a round needed", n, rounds);
    if (rounds > 64)
        return pd_err_set(e, PD_EINVAL, "%d rounds, at most 64", rounds);
    /* each step's reference: its second-fastest time over the rounds (the fastest with fewer
     * than 3), so that one round faster than every other is not what the others are held to */
    double ref[64], col[64], ratio[64], fastest[64];
    for (int i = 0; i < n; i++) {
        for (int k = 0; k < rounds; k++)
            if (!((col[k] = t[k * n + i]) > 0) || !isfinite(col[k]))
                return pd_err_set(e, PD_EINVAL, "step %d was not measured in round %d (%g s)", i, k, col[k]);
        qsort(col, (size_t)rounds, sizeof *col, cmp_double);
        ref[i] = col[rounds >= 3];
    }
    /* a round's level: its median time over the references; busy rounds and fast ones out */
    unsigned char *keep = r->keep;
    for (int k = 0; k < rounds; k++) {
        for (int i = 0; i < n; i++)
            ratio[i] = t[k * n + i] / ref[i];
        qsort(ratio, (size_t)n, sizeof *ratio, cmp_double);
        double med = r->level[k] = ratio[n / 2];
        if (med <= PD_CALIB_BUSY && med >= PD_CALIB_FAST) {
            keep[k] = 1;
            r->kept++;
            r->slowest = fmax(r->slowest, med);
        }
    }
    /* the fit on the fastest time of each point over the kept rounds (over all if none is) */
    for (int i = 0; i < n; i++) {
        fastest[i] = INFINITY;
        for (int k = 0; k < rounds; k++)
            if (keep[k] || !r->kept)
                fastest[i] = fmin(fastest[i], t[k * n + i]);
        pts[i].measured_s = fastest[i];
    }
    int rc = pd_calib_fit(p, pts, n, attention, &r->fit, e);
    if (rc || r->kept < 2)
        return rc;   /* one kept round: nothing to compare it with, undetermined */
    /* leave each kept round out in turn (a jackknife): the fit on the other kept rounds' fastest
     * times gives the range of every factor, and of the times it predicts */
    struct pd_calib_point own[64];
    double pred_lo[64], pred_hi[64];
    for (int k = 0; k < rounds; k++) {
        if (!keep[k])
            continue;
        for (int i = 0; i < n; i++) {
            own[i] = pts[i];
            own[i].measured_s = INFINITY;
            for (int j = 0; j < rounds; j++)
                if (j != k && keep[j])
                    own[i].measured_s = fmin(own[i].measured_s, t[j * n + i]);
        }
        struct pd_calib_fit f;
        pd_err ignore;
        if (pd_calib_fit(p, own, n, attention, &f, &ignore))
            continue;
        for (int i = 0; i < n; i++) {
            pred_lo[i] = r->fitted ? fmin(pred_lo[i], own[i].fitted_s) : own[i].fitted_s;
            pred_hi[i] = r->fitted ? fmax(pred_hi[i], own[i].fitted_s) : own[i].fitted_s;
        }
        if (r->fitted++ == 0) {
            r->lo = r->hi = f;
            continue;
        }
        r->lo.step_s = fmin(r->lo.step_s, f.step_s), r->hi.step_s = fmax(r->hi.step_s, f.step_s);
        r->lo.token_layer_s = fmin(r->lo.token_layer_s, f.token_layer_s);
        r->hi.token_layer_s = fmax(r->hi.token_layer_s, f.token_layer_s);
        r->lo.attention = fmin(r->lo.attention, f.attention), r->hi.attention = fmax(r->hi.attention, f.attention);
        r->lo.memory = fmin(r->lo.memory, f.memory), r->hi.memory = fmax(r->hi.memory, f.memory);
        r->lo.rms_rel = fmin(r->lo.rms_rel, f.rms_rel), r->hi.rms_rel = fmax(r->hi.rms_rel, f.rms_rel);
    }
    if (r->fitted < 2)
        return 0;   /* nothing to compare: undetermined */
    r->undetermined = 0;
    double span[3];
    for (int k = 0; k < 3; k++)
        span[k] = fabs(coef(&r->hi, k, attention) - coef(&r->lo, k, attention));
    for (int i = 0; i < n; i++) {
        double G, X[3];
        regressors(p, &pts[i], attention, &G, X);   /* each step costed once */
        r->spread = fmax(r->spread, (pred_hi[i] - pred_lo[i]) / pts[i].measured_s);
        for (int k = 0; k < 3; k++)
            r->moved[k] = fmax(r->moved[k], span[k] * X[k] / pts[i].measured_s);
    }
    for (int k = 0; k < 3; k++)
        if (r->moved[k] > PD_CALIB_DETERMINED)
            r->undetermined |= 1 << k;
    /* factors that trade against each other (a step's fixed and per-token costs, say) can each
     * swing while the times they predict hold: the fit is determined when those times are */
    if (r->spread <= PD_CALIB_DETERMINED)
        r->undetermined = 0;
    else if (!r->undetermined)
        r->undetermined = 7;
    if (r->fit.rms_rel > PD_CALIB_MAX_RMS)   /* the model does not describe these steps at all */
        r->undetermined = 7;
    return 0;
}
