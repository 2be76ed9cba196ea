/* model/unicode.h: the classes and case mappings of Unicode 16.0.0 from the generated tables,
 * with no locale involved. */
#include <criterion/criterion.h>
#include <locale.h>

#include "model/unicode.h"

static uint16_t cat(uint32_t cp)
{
    return pd_uc_feat(cp) & (PD_UC_L | PD_UC_M | PD_UC_N | PD_UC_P | PD_UC_S | PD_UC_Z | PD_UC_C);
}

Test(unicode, categories_of_unicode_16)
{
    cr_assert_eq(cat('A'), PD_UC_L);
    cr_assert_eq(cat('!'), PD_UC_P);
    cr_assert_eq(cat('+'), PD_UC_S);
    cr_assert_eq(cat(0xA0), PD_UC_Z);
    cr_assert_eq(cat(0x4E00), PD_UC_L);
    cr_assert_eq(cat(0x3001), PD_UC_P);    /* 、 punctuation, not a symbol (glibc said S) */
    cr_assert_eq(cat(0x2190), PD_UC_S);    /* ← */
    cr_assert_eq(cat(0x0301), PD_UC_M);
    cr_assert_eq(cat(0x24B6), PD_UC_S);    /* Ⓐ So */
    cr_assert_eq(cat(0x31350), PD_UC_L);   /* CJK Ext. H, 15.0 */
    cr_assert_eq(cat(0x2EBF0), PD_UC_L);   /* CJK Ext. I, 15.1 */
    cr_assert_eq(cat(0x1FAE9), PD_UC_S);   /* an emoji of 16.0 */
    cr_assert_eq(cat(0x10D40), PD_UC_N);   /* a Garay digit, 16.0 */
    cr_assert_eq(cat(0x1FAEA), PD_UC_C);   /* 17.0: unassigned in 16.0 */
    cr_assert_eq(cat(0xE000), PD_UC_C);    /* private use */
    cr_assert_eq(cat(0x10FFFF), PD_UC_C);
    cr_assert_eq(pd_uc_feat(PD_UC_BADCP + 0xFF), 0);
    cr_assert(pd_uc_feat(0x3000) & PD_UC_SPACE);
    cr_assert(pd_uc_feat(0x85) & PD_UC_SPACE);
    cr_assert(!(pd_uc_feat(0x200B) & PD_UC_SPACE));
    cr_assert(pd_uc_feat(0x203F) & PD_UC_WORD);   /* Pc */
    cr_assert(pd_uc_feat(0x1C89) & PD_UC_LU);     /* 16.0 */
    cr_assert(pd_uc_feat(0x1C8A) & PD_UC_LL);
    cr_assert(!(pd_uc_feat(0x01C5) & (PD_UC_LU | PD_UC_LL)));   /* ǅ is Lt */
}

Test(unicode, simple_case_mapping)
{
    cr_assert_eq(pd_uc_lower('A'), 'a');
    cr_assert_eq(pd_uc_upper('a'), 'A');
    cr_assert_eq(pd_uc_lower('a'), 'a');
    cr_assert_eq(pd_uc_lower(0x130), 'i');        /* İ */
    cr_assert_eq(pd_uc_upper(0x17F), 'S');        /* ſ */
    cr_assert_eq(pd_uc_lower(0x1C89), 0x1C8A);    /* 16.0 */
    cr_assert_eq(pd_uc_upper(0xDF), 0xDF);        /* ß: no simple upper case */
    cr_assert_eq(pd_uc_lower(PD_UC_BADCP + 0x41), PD_UC_BADCP + 0x41);
}

Test(unicode, no_locale_is_needed)
{
    /* the tables are the data: the C locale (no C.UTF-8 loaded anywhere) changes nothing */
    setlocale(LC_ALL, "C");
    cr_assert_eq(cat(0x2EBF0), PD_UC_L);
    cr_assert_eq(pd_uc_lower(0x391), 0x3B1);
}

Test(unicode, runs_cover_every_code_point_in_order)
{
    uint32_t start, prev = 0;
    uint16_t f;
    size_t i = 0;
    for (; pd_uc_run(i, &start, &f); i++) {
        cr_assert(i == 0 ? start == 0 : start > prev);
        cr_assert_eq(pd_uc_feat(start), f);
        prev = start;
    }
    cr_assert_gt(i, 1000);
    cr_assert_leq(prev, 0x10FFFF);
}
