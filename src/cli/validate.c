/* `pdmoe validate`: the performance model against published deployments. */
#include "cli/cli.h"
#include "core/file.h"
#include "model/config.h"
#include "plan/validate.h"

#include <jansson.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char *help =
    "usage: pdmoe validate [--cases FILE] [--json]\n"
    "Predicts each published deployment of validation/published.json (or FILE) with the performance\n"
    "model and prints a Markdown table: published figure, prediction, error, binding resource.\n"
    "--json: the cases as a JSON array instead (figures, status, reason, the model's terms).\n"
    "Exit status 0 when every case neither declared a known miss nor pending is within 25%, 1 otherwise.\n";

int pd_cli_validate(int argc, char **argv)
{
    const char *file = NULL;
    int json = 0;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--help") == 0 || strcmp(argv[i], "-h") == 0) {
            fputs(help, stdout);
            return 0;
        } else if (strcmp(argv[i], "--json") == 0) {
            json = 1;
        } else if (strcmp(argv[i], "--cases") == 0 && i + 1 < argc) {
            file = argv[++i];
        } else if (strcmp(argv[i], "--cases") == 0) {
            fprintf(stderr, "pdmoe validate: --cases needs a value\n");
            return 2;
        } else {
            fprintf(stderr, "pdmoe validate: unknown option %s (see pdmoe validate --help)\n", argv[i]);
            return 2;
        }
    }
    pd_err e = {0};
    char *owned = NULL;
    const char *text = NULL, *label = file ? file : "validation/published.json";
    if (file) {
        /* a regular file (a FIFO is named, never waited on), whole */
        if (!(owned = pd_file_read(file, 16 << 20, NULL, &e))) {
            fprintf(stderr, "pdmoe validate: --cases %s\n", e.msg);
            return 1;
        }
        text = owned;
    } else {
        text = pd_embedded_find(label);
    }
    struct pd_valcase *c;
    int n, rc = pd_validate_run(text, label, &c, &n, &e);
    free(owned);
    if (rc) {
        fprintf(stderr, "pdmoe validate: %s\n", e.msg);
        return 1;
    }
    char *md = NULL;
    if (json) {
        json_t *j = pd_validate_json(c, n);
        md = j ? json_dumps(j, JSON_INDENT(2)) : NULL;
        json_decref(j);
        if (md) {
            char *nl = realloc(md, strlen(md) + 2);
            if (nl)
                strcat(md = nl, "\n");
        }
    } else {
        md = pd_validate_markdown(c, n);
    }
    int worst = 0;
    for (int i = 0; i < n; i++)
        worst |= !c[i].known_miss[0] && !c[i].pending[0] && (c[i].error > 0.25 || c[i].error < -0.25);
    if (md)
        fputs(md, stdout);
    free(md);
    free(c);
    return md ? worst : 1;
}
