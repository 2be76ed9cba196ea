/* tools/perf-table.py, which writes the README's table of issue 17's benchmarks from their --json
 * documents: the verdict a row prints is the one the benchmark gave, on the number the row shows;
 * a document that lacks what a row prints is refused naming the file and the member; and the
 * documents kept in bench/results/ hold verdicts that today's targets (bench/report.h) still give. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <jansson.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/report.h"
#include "../run.h"

/* The row of the table (in out) that starts with `start`, NUL-ended in row. */
static int row_of(const char *out, const char *start, char *row, size_t cap)
{
    const char *p = strstr(out, start);
    if (!p)
        return 0;
    size_t n = strcspn(p, "\n");
    snprintf(row, cap, "%.*s", (int)(n < cap - 1 ? n : cap - 1), p);
    return 1;
}

Test(perf_table, rows_carry_the_benchmarks_verdicts)
{
    if (access("models/mini/model.safetensors", R_OK) != 0)
        cr_skip_test("models/mini not generated");
    char dir[] = "/tmp/pdmoe-perf-table-XXXXXX", line[512], row[4096];
    cr_assert_not_null(mkdtemp(dir));
    static struct run r;
    run("bench decode --quick --json --threads 1 --batch 1", &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    json_error_t je;
    json_t *doc = json_loads(r.out, 0, &je);
    cr_assert_not_null(doc, "%s", je.text);
    snprintf(line, sizeof line, "%s/decode.json", dir);
    cr_assert_eq(json_dump_file(doc, line, 0), 0);
    json_t *c = json_array_get(json_object_get(doc, "cases"), 0);
    const double frac = json_number_value(json_object_get(c, "of_bandwidth_roofline"));
    const int met = json_is_true(json_object_get(json_object_get(c, "target"), "met"));

    snprintf(line, sizeof line, "python3 tools/perf-table.py %s", dir);
    run_cmd(line, &r);
    cr_assert_eq(r.status, 0, "%s", r.err);
    cr_assert(row_of(r.out, "| decode v4-flash-mini, batch 1 | 1 |", row, sizeof row), "no row: %s", r.out);
    char want[128];
    snprintf(want, sizeof want, "17.5: %.2f >= 0.85, %s |", frac, met ? "**met**" : "not met");
    cr_assert(strstr(row, want), "want \"%s\" in %s", want, row);
    /* the command and the machine it ran on, as the document says */
    cr_assert(strstr(r.out, "`pdmoe bench decode --quick --json --threads 1 --batch 1`"), "%s", r.out);

    /* a document without the member a row prints: refused, naming the file and the member */
    json_object_del(c, "of_bandwidth_roofline");
    snprintf(line, sizeof line, "%s/decode.json", dir);
    cr_assert_eq(json_dump_file(doc, line, 0), 0);
    snprintf(line, sizeof line, "python3 tools/perf-table.py %s", dir);
    run_cmd(line, &r);
    cr_assert_eq(r.status, 1, "%s", r.out);
    snprintf(want, sizeof want, "perf-table: %s/decode.json: cases.0: no member of_bandwidth_roofline", dir);
    cr_assert(strstr(r.err, want), "want \"%s\" in %s", want, r.err);
    json_decref(doc);

    /* a directory without any document */
    snprintf(line, sizeof line, "%s/decode.json", dir);
    remove(line);
    snprintf(line, sizeof line, "python3 tools/perf-table.py %s", dir);
    run_cmd(line, &r);
    cr_assert_eq(r.status, 1);
    cr_assert(strstr(r.err, "none of kernels.json, decode.json, prefill.json, ep.json"), "%s", r.err);
    rmdir(dir);
}

/* Every target object in doc (walked whole): a bound today's targets have, and a verdict that bound
 * gives on the member it names in the object that holds it. */
static int check_targets(json_t *obj, const char *file)
{
    int n = 0;
    if (json_is_array(obj)) {
        for (size_t i = 0; i < json_array_size(obj); i++)
            n += check_targets(json_array_get(obj, i), file);
        return n;
    }
    if (!json_is_object(obj))
        return 0;
    json_t *t = json_object_get(obj, "target");
    if (json_is_object(t)) {
        json_t *lo = json_object_get(t, "min"), *hi = json_object_get(t, "max");
        const int floor = lo != NULL;
        const double bound = json_number_value(floor ? lo : hi);
        int known = 0;
        for (int k = 0; k < PD_TARGET_N; k++)
            known |= pd_bench_target_is_floor(k) == floor && pd_bench_target_bound(k) == bound;
        cr_assert(known, "%s: a target of %s %g that bench/report.h no longer sets: run the benchmarks again", file,
                  floor ? ">=" : "<=", bound);
        const char *metric = json_string_value(json_object_get(t, "metric"));
        json_t *v = json_object_get(obj, metric ? metric : "");
        cr_assert(json_is_number(v), "%s: the target judges %s, which its object lacks", file, metric);
        json_t *met = json_object_get(t, "met");
        if (!json_is_null(met)) {
            const double x = json_number_value(v);
            cr_assert_eq(json_is_true(met), floor ? x >= bound : x <= bound, "%s: %s %g judged %s against %g", file,
                         metric, x, json_is_true(met) ? "met" : "not met", bound);
        }
        n++;
    }
    const char *key;
    json_t *v;
    json_object_foreach(obj, key, v)
        if (strcmp(key, "target") != 0)
            n += check_targets(v, file);
    return n;
}

Test(perf_table, kept_documents_agree_with_todays_targets)
{
    DIR *top = opendir("bench/results");
    cr_assert_not_null(top, "no bench/results");
    int docs = 0, targets = 0;
    for (struct dirent *d; (d = readdir(top));) {
        if (d->d_name[0] == '.')
            continue;
        for (int f = 0; f < 4; f++) {
            static const char *const names[] = {"kernels", "decode", "prefill", "ep"};
            char path[512];
            snprintf(path, sizeof path, "bench/results/%s/%s.json", d->d_name, names[f]);
            if (access(path, R_OK) != 0)
                continue;
            json_error_t je;
            json_t *doc = json_load_file(path, 0, &je);
            cr_assert_not_null(doc, "%s: %s", path, je.text);
            cr_assert_str_eq(json_string_value(json_object_get(doc, "bench")), names[f], "%s", path);
            cr_assert(json_is_object(json_object_get(doc, "machine")), "%s: no machine", path);
            targets += check_targets(doc, path);
            docs++;
            json_decref(doc);
        }
    }
    closedir(top);
    cr_assert_gt(docs, 0, "no documents kept in bench/results");
    cr_assert_gt(targets, 0, "no target in the kept documents");
}
