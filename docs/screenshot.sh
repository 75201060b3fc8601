#!/usr/bin/env bash
# Render the placement page of a real program and screenshot it with headless Chromium.
#
# Installs nothing. It needs a Chromium on PATH; on Debian/Ubuntu:
#     apt-get install -y chromium
# (or set CHROMIUM=/path/to/chrome). The program drawn is the README example: the
# transformer block of ferry.examples compiled for cuda:0 with aten.softmax kept on the
# CPU; compiling needs no GPU.
#
# usage: docs/screenshot.sh [OUT.png]        (default: docs/placement.png)
#   PYTHON=/work/venv/bin/python docs/screenshot.sh
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
out="$(realpath -m "${1:-$root/docs/placement.png}")"
python="${PYTHON:-python}"
chromium="${CHROMIUM:-$(command -v chromium || command -v chromium-browser || command -v google-chrome || true)}"
if [ -z "$chromium" ]; then
    echo "screenshot.sh: no chromium on PATH; install it with: apt-get install -y chromium" >&2
    exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
page="$tmp/placement.html"

PYTHONPATH="$root/src${PYTHONPATH:+:$PYTHONPATH}" "$python" - "$page" <<'PY'
import sys

import torch

import ferry
from ferry.examples import transformer_block
from ferry.views import write_html

model, inputs = transformer_block()
program = ferry.compile(torch.export.export(model, inputs),
                        ferry.OpSupportPartitioner("cuda:0", exclude=["aten.softmax"]))
write_html(program, sys.argv[1])
PY

"$chromium" --headless --no-sandbox --disable-gpu --hide-scrollbars \
    --screenshot="$out" --window-size=1400,2000 "file://$page" 2>/dev/null
echo "wrote $out ($(wc -c <"$out") bytes)"
