/* The plan as one self-contained HTML page (`pdmoe plan --html`, `pdmoe search --html`): a
 * summary, per-card stacked memory bars for prefill and decode drawn to scale against the
 * card's capacity, the expert-to-card map of each role, the Pareto chart of a search with the
 * chosen layout marked, the performance prediction and the plan's tables. Inline CSS and
 * inline SVG only: no script, no font, no external reference, so the file can be mailed or
 * archived and still open in any browser.
 *
 * The SVG carries its numbers for machines too: every memory segment is a
 * <rect class="seg KIND" width="W" data-bytes="B">, every expert-map cell a
 * <rect class="x"> (class "x rep" for a redundant copy) inside <svg id="map-ROLE">. */
#ifndef PD_PLAN_HTML_H
#define PD_PLAN_HTML_H

#include "core/err.h"
#include "plan/perf.h"
#include "plan/plan.h"
#include "plan/search.h"

/* f and s may be NULL (no prediction, no search); with a search, p is its best layout's plan.
 * units: enum pd_units. Returns a malloc'ed NUL-terminated page, or NULL with e filled. */
char *pd_report_html(const struct pd_plan *p, const struct pd_perf *f, const struct pd_search *s, int units,
                     pd_err *e);

#endif
