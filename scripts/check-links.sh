#!/usr/bin/env bash
# Every relative link in README.md, ARCHITECTURE.md, CHANGELOG.md and docs/**/*.md points
# to a file that exists, and a `#fragment` into a Markdown file to one of
# its headings (GitHub's anchors: lower case, punctuation dropped, spaces to
# dashes). Links with a scheme (https:, mailto:) are not followed. Prints
# each broken link as `file: target` and fails if there was one.
set -euo pipefail
cd "$(dirname "$0")/.."

# anchors FILE: the anchor of each heading of a Markdown file, one a line
# (headings inside ``` fences are not headings).
anchors() {
    awk '/^```/ { fenced = !fenced } !fenced && /^#+ / { sub(/^#+ +/, ""); print }' "$1" |
        tr '[:upper:]' '[:lower:]' |
        sed -e 's/[^a-z0-9 _-]//g' -e 's/ /-/g'
}

broken=0
mapfile -t pages < <({ ls README.md ARCHITECTURE.md CHANGELOG.md; find docs -name '*.md'; } | sort)
for page in "${pages[@]}"; do
    dir=$(dirname "$page")
    # Inline links and images, outside code spans: ](target) or ](target "title").
    while IFS= read -r target; do
        case "$target" in
            *://* | mailto:* | "") continue ;;
        esac
        path=${target%%#*}
        fragment=
        [ "$path" != "$target" ] && fragment=${target#*#}
        file=$page
        [ -n "$path" ] && file="$dir/$path"
        if [ ! -e "$file" ]; then
            echo "$page: $target (no such file)" >&2
            broken=1
        elif [ -n "$fragment" ] && [[ "$file" == *.md ]] && ! anchors "$file" | grep -qxF -- "$fragment"; then
            echo "$page: $target (no heading with that anchor in $file)" >&2
            broken=1
        fi
    done < <(sed -e 's/`[^`]*`//g' "$page" | grep -oE '\]\([^) ]+' | sed 's/^](//')
done
if [ "$broken" -ne 0 ]; then
    echo "check-links: broken links above" >&2
    exit 1
fi
echo "check-links: every relative link in ${#pages[@]} pages resolves" >&2
