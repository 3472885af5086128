#!/usr/bin/env bash
# Render a `fedsec report` HTML page in headless Chromium and save a screenshot, to check by eye
# that the page renders and its images (plots, reconstruction grids) are visible. Not run in CI.
#
# Usage:   bench/screenshot_report.sh [REPORT_DIR_OR_HTML] [OUT_PNG]
#          defaults: runs/report-default/report.html  →  runs/report.png
# Needs:   chromium (Debian: `apt-get update && apt-get install -y chromium`).
# Make the report first, e.g.:
#          fedsec report --methods fedecouple,fedper,fedpac,fedproto --threads 1 --out runs/report-default
# Then open OUT_PNG in an image viewer. The script also fails if the page is not self-contained
# (an <img> whose src is not a data: URI, or any http(s) reference) or if the screenshot is blank.
set -euo pipefail

target="${1:-runs/report-default/report.html}"
png="${2:-runs/report.png}"
[[ -d "$target" ]] && target="$target/report.html"
[[ -f "$target" ]] || { echo "error: $target not found (run fedsec report first)" >&2; exit 2; }
command -v chromium >/dev/null || { echo "error: chromium not installed (apt-get install -y chromium)" >&2; exit 2; }

page="$(cd "$(dirname "$target")" && pwd)/$(basename "$target")"
if grep -Eqi '(src|href)[[:space:]]*=[[:space:]]*["'"'"']?(https?:|//)' "$page"; then
  echo "error: $page references an external resource" >&2; exit 1
fi
images=$(grep -o '<img src="data:image/png;base64,' "$page" | wc -l)
others=$(grep -o '<img src="[^d]' "$page" | wc -l || true)
echo "embedded images: $images, other images: $others"
[[ "$images" -ge 2 && "$others" -eq 0 ]] || { echo "error: expected embedded PNG images only" >&2; exit 1; }

rm -f "$png"
timeout 180 chromium --headless --no-sandbox --disable-gpu --disable-background-networking \
  --disable-component-update --no-first-run --hide-scrollbars \
  --screenshot="$png" --window-size=1200,3000 "file://$page" 2>/dev/null || true
[[ -s "$png" ]] || { echo "error: chromium wrote no screenshot" >&2; exit 1; }

# a blank page compresses to almost nothing: a rendered report with images is far larger
size=$(stat -c %s "$png")
echo "screenshot: $png ($size bytes)"
[[ "$size" -gt 50000 ]] || { echo "error: the screenshot looks blank" >&2; exit 1; }
