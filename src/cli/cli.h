/* Subcommands of the pdmoe program and the argument helpers they share. */
#ifndef PD_CLI_CLI_H
#define PD_CLI_CLI_H

#include <stdint.h>

int pd_cli_plan(int argc, char **argv);
int pd_cli_bench(int argc, char **argv);
int pd_cli_genmodel(int argc, char **argv);
int pd_cli_generate(int argc, char **argv);
int pd_cli_serve(int argc, char **argv);
int pd_cli_proxy(int argc, char **argv);
int pd_cli_up(int argc, char **argv);

/* Parses an integer flag value: digits with an optional k (x1000) or K (x1024) suffix, as
 * vLLM reads --max-model-len. Prints "pdmoe: --flag VALUE: ..." and returns -1 on error. */
int pd_cli_int(const char *flag, const char *s, int64_t min, int64_t *out);
int pd_cli_double(const char *flag, const char *s, double *out);

#endif
