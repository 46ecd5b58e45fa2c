# Used by scripts/check-portable.sh: prints `file:line: std::os::<platform>
# outside #[cfg(<platform>)]` for every OS-specific std path that no cfg
# gates, and exits 1 if there was one. Line-based: an outer `#[cfg(..)]`
# gates the next item (to the end of its block, or its `;`), an inner
# `#![cfg(..)]` near the top gates the file; braces count outside strings,
# brace char literals and `//` comments; a gate with `not(` never counts.
function gate_of(attr) {
    if (attr ~ /not\(/) return ""
    if (attr ~ /target_os *= *"linux"/) return "linux"
    if (attr ~ /(^|[^a-z_])windows([^a-z_]|$)/) return "windows"
    # Any other named OS (macos, freebsd, ...) is a unix.
    if (attr ~ /target_os *= *"[a-z]+"/) return "unix"
    if (attr ~ /(^|[^a-z_])unix([^a-z_]|$)/) return "unix"
    return ""
}
# Whether the gates in force cover a path that needs `need`.
function covered(need,   i) {
    if (file_gate == need || (need == "unix" && file_gate == "linux")) return 1
    for (i = 1; i <= n; i++)
        if (gates[i] == need || (need == "unix" && gates[i] == "linux")) return 1
    if (item_gate == need || (need == "unix" && item_gate == "linux")) return 1
    return 0
}
FNR == 1 { depth = 0; n = 0; pending = ""; item_gate = ""; file_gate = "" }
{
    line = $0
    # Attributes: an inner #![cfg] gates the file, an outer one the next item.
    while (match(line, /^[ \t]*#!?\[[^]]*\]/)) {
        attr = substr(line, RSTART, RLENGTH)
        line = substr(line, RSTART + RLENGTH)
        if (attr ~ /^[ \t]*#!\[cfg\(/) { if (FNR < 40) file_gate = gate_of(attr) }
        else if (attr ~ /^[ \t]*#\[cfg\(/ && gate_of(attr) != "") pending = gate_of(attr)
    }
    if (line ~ /^[ \t]*$/) next
    gsub(/\\\\/, "", line)               # escaped backslashes, then strings
    gsub(/"([^"\\]|\\.)*"/, "\"\"", line)
    gsub(/'[{}]'/, "''", line)          # char literals of braces
    sub(/\/\/.*/, "", line)              # comments (doc comments too)
    if (line ~ /^[ \t]*$/) next

    if (pending != "" && item_gate == "") { item_gate = pending; item_depth = depth }
    pending = ""

    rest = line
    while (match(rest, /std::os::[a-z_]+/)) {
        platform = substr(rest, RSTART + 9, RLENGTH - 9)
        rest = substr(rest, RSTART + RLENGTH)
        need = platform
        if (platform == "raw") continue
        if (platform == "fd") need = "unix"
        if (!covered(need)) {
            printf "%s:%d: std::os::%s outside #[cfg(%s)]\n", FILENAME, FNR, platform, need
            bad = 1
        }
    }

    opens = gsub(/{/, "{", line); closes = gsub(/}/, "}", line)
    before = depth
    depth += opens - closes
    # The gated item opened a block: the gate holds until it closes.
    if (item_gate != "" && depth > before) { gates[++n] = item_gate; starts[n] = item_depth; item_gate = "" }
    # ...or it ended on this line: `use ...;`, a unit struct, `fn f() { .. }`.
    else if (item_gate != "" && depth == item_depth && line ~ /[;}][ \t]*$/) item_gate = ""
    while (n > 0 && depth <= starts[n]) n--
}
END { exit bad }
