#!/bin/sh
# Render diagrams/*.mmd (or the sources named as arguments) to SVGs whose labels are SVG <text>.
#
#   MMDC_DIR=/tmp/mmdc diagrams/render.sh [diagrams/x.mmd ...]
#
# MMDC_DIR is the scratch directory where mermaid-cli is installed, with its cfg.json for Puppeteer
# (see diagrams/README.md). mermaid.config.json turns Mermaid's HTML labels off, so no label is drawn
# inside a <foreignObject>. Mermaid then writes each word of a label as its own <tspan>, the space
# before it included; xml:space="preserve" on the root keeps those spaces in renderers that strip
# leading spaces per <tspan> (rsvg-convert does), which would otherwise run the words together.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
mmdc_dir=${MMDC_DIR:-/tmp/mmdc}
mmdc="$mmdc_dir/node_modules/.bin/mmdc"
[ -x "$mmdc" ] || { echo "no mermaid-cli at $mmdc: install it as diagrams/README.md says, or set MMDC_DIR" >&2; exit 1; }
[ "$#" -gt 0 ] || set -- "$here"/*.mmd
for src in "$@"; do
    svg="${src%.mmd}.svg"
    "$mmdc" -q -p "$mmdc_dir/cfg.json" -c "$here/mermaid.config.json" -i "$src" -o "$svg"
    sed -i '1s/^<svg /<svg xml:space="preserve" /' "$svg"
    grep -q '^<svg xml:space="preserve" ' "$svg" || { echo "$svg: unexpected start, xml:space not added" >&2; exit 1; }
    echo "rendered $svg"
done
