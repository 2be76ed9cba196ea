/* Non-negative least squares over three unknowns (calibrate.h): the best over every subset of
 * unknowns left free (the others at zero) whose normal equations give no negative value. The
 * third unknown is a factor's excess cost d = 1/factor - 1 >= 0. */
#include "plan/calibrate.h"
#include "plan/perf.h"

#include <math.h>
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

int pd_calib_fit(const struct pd_plan *p, struct pd_calib_point *pts, int n, double attention,
                 struct pd_calib_fit *f, pd_err *e)
{
    memset(f, 0, sizeof *f);
    if (n < 3)
        return pd_err_set(e, PD_EINVAL, "calibrate: %d measurements, at least 3 needed", n);
    double X[64][3], y[64], G[64];
    if (n > 64)
        n = 64;
    for (int i = 0; i < n; i++) {
        struct pd_step s;
        pd_perf_step(p, pts[i].role, pts[i].seqs, pts[i].tokens, pts[i].ctx, &s);
        X[i][0] = 1;
        X[i][1] = (double)(pts[i].seqs * pts[i].tokens) * p->kv.n;
        if (attention > 0) {      /* decode: attention known, the weight stream's factor fitted */
            G[i] = s.gemm_compute_s + s.attn_s / attention;
            X[i][2] = s.gemm_memory_s * p->hw.eff.memory;
        } else {                  /* prefill: the GEMMs known, attention's factor fitted */
            G[i] = s.gemm_compute_s + s.gemm_memory_s;
            X[i][2] = s.attn_s;
        }
        /* the factor is at most 1 (no kernel beats the peak): its column's coefficient 1/factor
         * is 1 + d with d >= 0, the "1" moved into the known part */
        G[i] += X[i][2];
        y[i] = pts[i].measured_s - G[i];
    }
    /* relative errors matter: weight each row by 1 / measured */
    double best_err = INFINITY, best[3] = {0, 0, 0};
    for (int mask = 1; mask < 8; mask++) {
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
        if (solve(k, a, b, x))
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
        return pd_err_set(e, PD_EINVAL, "calibrate: the measurements admit no non-negative fit");
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
