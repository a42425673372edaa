#!/usr/bin/env bash
# Builds (or reuses) the venv that runs checkov for `make scan` (scan/run.py). checkov
# brings ~95 packages whose pins clash with the project's, so it gets a venv of its own.
#
# The venv lands in a cache folder OUTSIDE the checkout, keyed by requirements.txt (every
# package pinned exactly), the recipe and the interpreter's version, so a fresh clone on
# the same machine (CI) reuses it and a pin bump builds anew. A build goes into a
# temporary folder that is renamed into place only when checkov runs from it: a killed
# build never leaves a venv that looks complete. (The pattern of tests/vllm/venv.sh.)
#
# Usage: venv.sh            build if needed; the last line printed is the venv's checkov
#        venv.sh --checkov  print the checkov this checkout expects; build nothing
#        venv.sh --check    exit 0 when that venv is complete, 1 otherwise
#        venv.sh --resolve  install requirements.txt's checkov pin alone in a throwaway
#                           venv and print what pip resolved, in requirements.txt's form
#                           (after a bump: edit the pin, then regenerate the file with it)
#
# Environment:
#   PYTHON                    the interpreter to build with (default python3)
#   WEIGHTCACHE_CHECKOV_CACHE cache root (default ${XDG_CACHE_HOME:-~/.cache}/weightcache)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REQUIREMENTS="$HERE/requirements.txt"
# Bump when the steps below change, so that old venvs are not reused.
RECIPE=1
PYTHON="${PYTHON:-python3}"
PIP_FLAGS=(--disable-pip-version-check -q)

log() { printf '[checkov-venv %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

pin() { grep -E '^checkov==' "$REQUIREMENTS"; }

digest() {
    { cat "$REQUIREMENTS"; echo "recipe=$RECIPE"
      "$PYTHON" -c 'import platform, sys; print(sys.version, platform.machine())'; } | sha256sum | cut -c1-10
}

venv_dir() {
    local root="${WEIGHTCACHE_CHECKOV_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightcache}"
    echo "$root/checkov-$(digest)"
}

# Complete: the folder exists (it appears only by the final rename) and says so.
complete() { [[ -x "$1/bin/checkov" && -f "$1/VERSIONS" ]]; }

build_into() {  # build_into TMP FINAL: ~35 s and ~300 MB
    local dir="$1" final="$2" want got
    "$PYTHON" -m venv "$dir"
    log "installing $(pin) and its pinned set ($(grep -c '^[^#]' "$REQUIREMENTS") packages)"
    "$dir/bin/python" -m pip install "${PIP_FLAGS[@]}" -r "$REQUIREMENTS"
    "$dir/bin/python" -m pip check >&2
    # A venv records its own path in pyvenv.cfg and in its scripts' shebangs: point them
    # at the final folder before the rename (python itself finds its prefix at run time).
    grep -rlI --null -F "$dir" "$dir/bin" "$dir/pyvenv.cfg" | xargs -0 -r sed -i "s|$dir|$final|g"
    want="$(pin | cut -d= -f3)"
    got="$("$dir/bin/python" -m checkov.main --version 2>/dev/null || true)"
    [[ "$got" == "$want" ]] || { log "checkov in the new venv says ${got:-nothing}, not $want"; return 1; }
}

resolve() {
    local tmp
    tmp="$(mktemp -d)"
    trap "rm -rf '$tmp'" EXIT
    "$PYTHON" -m venv "$tmp/venv"
    "$tmp/venv/bin/python" -m pip install "${PIP_FLAGS[@]}" "$(pin)"
    echo "# checkov and every package it installs, pinned exactly: the checkov venv's key (scan/venv.sh)."
    echo "# Regenerate after a bump: edit checkov's pin, bash scan/venv.sh --resolve > scan/requirements.txt"
    "$tmp/venv/bin/python" -m pip freeze --all | grep -v -i -E '^(pip|setuptools|wheel)==' | sort -f
}

main() {
    local dir
    dir="$(venv_dir)"
    case "${1:-}" in
        --checkov) echo "$dir/bin/checkov"; return ;;
        --check) complete "$dir"; return ;;
        --resolve) resolve; return ;;
        "") ;;
        *) echo "usage: $0 [--checkov|--check|--resolve]" >&2; return 2 ;;
    esac
    if complete "$dir"; then  # the fast path: no lock needed to read a finished venv
        echo "$dir/bin/checkov"
        return
    fi
    mkdir -p "$(dirname "$dir")"
    # One build per key at a time; a second caller waits and then reuses it.
    exec 9>"$dir.lock"
    if ! flock -n 9; then
        log "another build of $dir is running; waiting for it"
        flock 9
    fi
    if ! complete "$dir"; then
        local tmp="$dir.tmp.$$" start=$SECONDS
        rm -rf "$dir".tmp.*  # left by a killed build: we hold the lock, so none is live
        trap "rm -rf '$tmp'" EXIT  # expanded now: main's locals are gone when EXIT runs
        log "cold build into $dir ($("$PYTHON" --version))"
        build_into "$tmp" "$dir"
        printf '%s\nrecipe=%s\npython=%s\nbuild_seconds=%s\n' "$(pin)" "$RECIPE" \
            "$("$PYTHON" --version | cut -d' ' -f2)" "$((SECONDS - start))" >"$tmp/VERSIONS"
        rm -rf "$dir"
        mv "$tmp" "$dir"  # the atomic step: the venv appears only when complete
        trap - EXIT
        log "built in $((SECONDS - start)) s: $dir ($(du -sh "$dir" | cut -f1))"
    fi
    echo "$dir/bin/checkov"
}

main "$@"
