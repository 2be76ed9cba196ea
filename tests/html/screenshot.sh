#!/bin/sh
# Renders pdmoe's HTML reports in headless Chromium and checks every screenshot is a PNG that is
# not one colour throughout: a page the browser failed to lay out comes back blank.
#
#   tests/html/screenshot.sh                 the pages the plan/html_* tests render (seed plan,
#                                            search + prediction, a KV pool over capacity)
#   tests/html/screenshot.sh report.html ... given pages, e.g. from `pdmoe plan --html`
#
# Screenshots go to $OUT (default build/html-screenshots). Needs chromium (Debian: apt-get install
# chromium) and python3 (standard library only, for the PNG check). .ci/run runs it.
set -eu
cd "$(dirname "$0")/../.."
OUT=${OUT:-build/html-screenshots}
mkdir -p "$OUT"
command -v chromium >/dev/null || { echo "screenshot.sh: chromium is not installed (apt-get install chromium)" >&2; exit 2; }
if [ $# -eq 0 ]; then
  make -j2 build/pdmoe-tests >/dev/null
  PDMOE_HTML_OUT="$OUT" ./build/pdmoe-tests --filter 'plan/html_*' >"$OUT/tests.log" 2>&1 || { cat "$OUT/tests.log" >&2; exit 1; }
  set -- "$OUT"/seed.html "$OUT"/search.html "$OUT"/over.html
fi
fail=0
for page in "$@"; do
  png="$OUT/$(basename "$page" .html).png"
  rm -f "$png"
  # --virtual-time-budget: capture once the page has settled, not at the first paint
  timeout 120 chromium --headless --no-sandbox --disable-gpu --hide-scrollbars --virtual-time-budget=2000 \
      --window-size=1100,3000 --screenshot="$png" "file://$(realpath "$page")" >"$OUT/chromium.log" 2>&1 || true
  if python3 - "$png" <<'PY'
import struct, sys, zlib
path = sys.argv[1]
try:
    data = open(path, "rb").read()
except OSError:
    sys.exit("no screenshot written")
if len(data) < 100 or data[:8] != b"\x89PNG\r\n\x1a\n":
    sys.exit("not a PNG (%d bytes)" % len(data))
pos, idat = 8, b""
while pos < len(data):
    n, kind = struct.unpack(">I4s", data[pos:pos + 8])
    body = data[pos + 8:pos + 8 + n]
    if kind == b"IHDR":
        w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
    elif kind == b"IDAT":
        idat += body
    pos += 12 + n
if depth != 8 or ctype not in (2, 6):
    sys.exit("unexpected PNG format: depth %d, colour type %d" % (depth, ctype))
bpp = 3 if ctype == 2 else 4
raw, stride = zlib.decompress(idat), w * bpp
prev, counts = bytearray(stride), {}
for y in range(h):
    f, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1:(y + 1) * (stride + 1)])
    for i in range(stride):  # undo the row filter (PNG spec, 9.2)
        a = line[i - bpp] if i >= bpp else 0
        b, c = prev[i], prev[i - bpp] if i >= bpp else 0
        if f == 1: line[i] = (line[i] + a) & 255
        elif f == 2: line[i] = (line[i] + b) & 255
        elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
        elif f == 4:
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    for x in range(0, stride, bpp * 4):  # every 4th pixel is plenty
        k = bytes(line[x:x + 3])
        counts[k] = counts.get(k, 0) + 1
    prev = line
total, top = sum(counts.values()), max(counts.values())
other = 1 - top / total
print("%dx%d, %d colours, %.1f%% of pixels not the background" % (w, h, len(counts), 100 * other))
if len(counts) < 2 or other < 0.01:
    sys.exit("the page is (almost) one colour: nothing rendered")
PY
  then echo "ok   $png"; else echo "FAIL $page (chromium log: $OUT/chromium.log)"; fail=1; fi
done
exit $fail
